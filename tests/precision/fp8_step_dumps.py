"""Child process of test_fp8_gemms.py: one XLA-compiled fp8 train step per case, dumped.

    XLA_FLAGS="--xla_dump_to=DIR/all --xla_dump_hlo_as_text" \
        python -m tests.precision.fp8_step_dumps DIR CASES_JSON

CASES_JSON maps a case name to [mesh axes or null (no mesh), recipe, remat] and, optionally,
more config settings (a mixture of experts' model section). XLA writes
every module it compiles into one directory per process; after each case's step the
modules written since the previous case are moved into DIR/<case>. DIR/cases.json then
gives, per case, the devices that compiled the step and the model's FP8 projections.
"""

import glob
import json
import os
import shutil
import sys

import tests.conftest  # noqa: F401  first: splits the CPU into 8 devices
from tests.harness import tiny_config
from tfllm.data import feed
from tfllm.data import SyntheticTokens
from tfllm.parallel import make_parallel
from tfllm.train.state import build_train_state


def run_case(axes, recipe, remat, extra=None) -> dict:
    # One block: 7 FP8 projections are enough to see every kind of GEMM, at half the
    # compile time of the usual two.
    cfg = tiny_config("llama", axes or "data=1", **{
        "precision.policy": "fp8", "precision.fp8_recipe": recipe, "model.remat": remat,
        "model.num_layers": 1, "train.jit_compile": "true", **(extra or {})})
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer) if axes else None
    step = build_train_state(cfg, parallel, jit_compile=True).step
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=3)
    # returns numpy
    step(feed.to_device(step.parallel, data.batch(0, cfg.train.global_batch_size, 1)))
    devices = 1 if parallel is None else parallel.mesh.num_local_devices()
    # Three amax histories (x, w, output gradient) per FP8 projection.
    return {"devices": devices, "projections": len(step.model.fp8_state_variables()) // 3}


def main(out_dir: str, cases_json: str) -> None:
    dump = os.path.join(out_dir, "all")
    summary = {}
    for name, case in json.loads(cases_json).items():
        summary[name] = run_case(*case)
        os.makedirs(os.path.join(out_dir, name))
        for path in glob.glob(os.path.join(dump, "*")):
            shutil.move(path, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
