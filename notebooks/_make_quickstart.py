"""Writes notebooks/01_quickstart.ipynb (outputs cleared). Run from anywhere:

    python notebooks/_make_quickstart.py
"""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

CELLS = [
    ("md", """\
# tfllm quickstart

This notebook walks through the whole tfllm workflow on a laptop CPU:

1. split the CPU into 8 logical devices, so an 8-device mesh can run anywhere;
2. load a config preset and override a few values;
3. print where every weight lives on the mesh, without allocating it;
4. train a tiny GPT and read its metrics;
5. change the architecture by subclassing a model, without touching any sharding code.

Run it from the `notebooks/` directory (the default in Jupyter): paths such as
`../configs/tiny.yaml` are relative to this notebook."""),

    ("md", """\
## 1. Setup: 8 logical CPU devices

tfllm runs on DTensor, which shards tensors over a *mesh* of devices. On a GPU/TPU host
those are the accelerators; on CPU, tfllm splits the host into several **logical**
devices, so that the same 8-device mesh (and the same sharding code) runs on a laptop.

TensorFlow fixes its device list the first time it initializes devices, so
`setup_cpu_devices` must run **before anything else touches TensorFlow** (restart the
kernel if you already ran TF code). We also pick the Keras backend before Keras is
imported, because Keras 3 reads `KERAS_BACKEND` only once."""),
    ("code", """\
import os
os.environ["KERAS_BACKEND"] = "tensorflow"

from tfllm.parallel.mesh import setup_cpu_devices
print("logical CPU devices:", setup_cpu_devices(8))"""),

    ("md", """\
## 2. Load a config

A tfllm run is described by one typed config: defaults from the schema, then a YAML
preset, then `section.key=value` overrides (the same strings the `tfllm` CLI accepts).
Unknown keys and bad values fail here, at load time, rather than halfway through training.

We start from `configs/tiny.yaml` (a 2-layer GPT that trains in seconds) and override:

* `mesh.axes=data=2,fsdp=2,model=2`: a 2x2x2 mesh of the 8 devices, combining
  data parallelism, fully sharded weights (FSDP) and tensor (model) parallelism;
* `train.steps=30`, `train.log_every=10`: a short run that logs every 10 steps."""),
    ("code", """\
import tfllm.config
from tfllm.config import load_config

cfg = load_config("../configs/tiny.yaml", [
    "mesh.axes=data=2,fsdp=2,model=2",
    "train.steps=30",
    "train.log_every=10",
])

# The resolved config as YAML; we print only the model section here.
text = tfllm.config.dump_yaml(cfg)
print(text[text.index("model:"):text.index("\\nmesh:")])
print("mesh.axes:", cfg.mesh.axes)"""),

    ("md", """\
## 3. Inspect the layout before allocating anything

Model code never mentions devices: each weight is tagged with **logical axes**
(`embed`, `mlp`, `heads`, `vocab`, ...). A **rules table** maps logical axes to mesh
axes (`data`, `fsdp`, `model`), and that decides how each weight is split.

`build_model(cfg, allocate=False)` builds the model with shapes only, so this table costs
no memory: you can check a 70B config's layout, and its bytes per device, on a laptop
before renting any hardware."""),
    ("code", """\
from tfllm.models import build_model
from tfllm.parallel.layouts import layout_rows, format_table, mesh_shape_from_config
from tfllm.parallel.rules import rules_from_config

shape = mesh_shape_from_config(cfg)
abstract = build_model(cfg, allocate=False)
print(format_table(layout_rows(abstract, rules_from_config(cfg.mesh.rules), shape), shape))"""),

    ("md", """\
## 4. Train

`train(cfg, workdir)` builds the mesh, creates the variables directly in their sharded
layouts, and runs the compiled train step on synthetic tokens. It writes the resolved
config to `WORKDIR/config.yaml` (so a run can be reproduced) and one JSON line per
logged step to `WORKDIR/metrics.jsonl`, and returns the last logged metrics.

The first step includes compilation, so it is slow and is not counted in `tokens_per_s`.
`metrics.jsonl` is appended to: we clear the directory first so reruns start fresh."""),
    ("code", """\
import shutil
from tfllm.train.loop import train

shutil.rmtree("/tmp/tfllm_notebook_run", ignore_errors=True)
last = train(cfg, "/tmp/tfllm_notebook_run")
last"""),
    ("md", """\
`metrics.jsonl` is plain JSON lines, easy to load into pandas or plot; here we just
print the loss at each logged step. The synthetic tokens follow a fixed permutation of
the vocabulary (with 10% noise), so the model can learn them: the loss starts near
log(vocab_size) = log(128) = 4.85 and falls well below it."""),
    ("code", """\
import json

with open("/tmp/tfllm_notebook_run/metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
for r in records:
    print(f"step {r['step']:>3}  loss {r['loss']:.4f}")"""),

    ("md", """\
## 5. Your own architecture: subclass `CausalLM`

`GPT` and `Llama` are subclasses of `tfllm.models.CausalLM`, which builds the model
through small hooks (`make_attention`, `make_mlp`, `make_norm`, `embed`, `head`, ...).
To try a new idea, override one hook.

Here we replace GPT's GELU MLP with a squared-ReLU MLP. Note what the layer does **not**
contain: no mesh, no layouts, no DTensor. `add_param` creates each weight and records
its logical axes (`("embed", "mlp")` for the up projection, `("mlp", "embed")` for the
down projection); the rules table turns these into a mesh layout, so the same layer runs
unchanged on 1 device, on this 2x2x2 CPU mesh, or on a multi-host GPU mesh.

`build(self, input_shape=None)` creates the weights: tfllm builds models from the config's
shapes (not from a sample batch), so that it can place every variable before any data
flows."""),
    ("code", """\
import keras
import tensorflow as tf

import tfllm.models
from tfllm.models.common import add_param


class SquaredReLUMLP(keras.layers.Layer):
    \"\"\"up (E -> F), relu(.)**2, down (F -> E).\"\"\"

    def __init__(self, hidden_dim, intermediate_dim, **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim, self.intermediate_dim = hidden_dim, intermediate_dim

    def build(self, input_shape=None):
        hidden, inter = self.hidden_dim, self.intermediate_dim
        # Logical axes only: the rules table decides which mesh axes split them.
        self.up = add_param(self, "up", (hidden, inter), ("embed", "mlp"),
                            ("normal", 0.02), "kernel")
        self.down = add_param(self, "down", (inter, hidden), ("mlp", "embed"),
                              ("normal", 0.02), "kernel")

    def call(self, x):
        h = tf.einsum("btd,df->btf", x, self.up)
        h = tf.square(tf.nn.relu(h))
        return tf.einsum("btf,fd->btd", h, self.down)


class MyGPT(tfllm.models.GPT):
    def make_mlp(self, index):
        return SquaredReLUMLP(self.config.hidden_dim, self.config.intermediate_dim, name="mlp")"""),
    ("md", """\
Before training, the layout table shows the new weights (`.../mlp/up`, `.../mlp/down`)
picked up their layouts from the same rules, with no sharding code in the layer."""),
    ("code", """\
abstract = build_model(cfg, model_cls=MyGPT, allocate=False)
rows = layout_rows(abstract, rules_from_config(cfg.mesh.rules), shape)
print(format_table([r for r in rows if "/mlp/" in r.path], shape))"""),
    ("md", """\
Training it is the same call, with `model_cls=MyGPT`: the train loop, optimizer (whose
states are sharded like the weights), and mesh are all reused."""),
    ("code", """\
shutil.rmtree("/tmp/tfllm_notebook_run2", ignore_errors=True)
last2 = train(cfg, "/tmp/tfllm_notebook_run2", model_cls=MyGPT)
print(f"GELU MLP final loss:         {last['loss']:.4f}")
print(f"squared-ReLU MLP final loss: {last2['loss']:.4f}")"""),

    ("md", """\
## Next steps

* The project `README.md` covers configuration and presets, the parallelism
  (mesh axes and the rules table), custom models, and the `tfllm` command line.
* Check a large model's layout and per-device memory without any accelerator, from the
  repository root:

  ```
  tfllm layouts --config configs/llama-70b.yaml
  ```
* Train from the command line with the same config and overrides as above:

  ```
  tfllm train --config configs/tiny.yaml --workdir /tmp/run --set mesh.axes=data=2,fsdp=2,model=2
  ```"""),
]


def main():
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src)
                for kind, src in CELLS]
    nbformat.validate(nb)
    path = os.path.join(HERE, "01_quickstart.ipynb")
    nbformat.write(nb, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
