"""One client of a multi-client checkpoint save (run by test_multiclient_checkpoint.py).

Usage: DTENSOR_JOBS=... DTENSOR_CLIENT_ID=i python tests/checkpoint/multiclient_save.py \
  DIR OVERRIDES_JSON

Builds the tiny model and AdamW on the mesh the overrides name, fills every variable with
`reference_value(name)` (a deterministic function of the name, so another process can
check the restored values bit for bit), saves one checkpoint with a per-client file, and
prints one JSON line with what DTensor reported for client id and count.

Importing this module does not initialize TensorFlow (the test imports reference_value).
"""

import json
import os
import sys
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reference_value(name: str, shape, dtype) -> np.ndarray:
    """A deterministic, name-dependent global value for a variable."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 1000, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)


def fill_reference(variables) -> None:
    """Assigns every variable its `reference_value`, shard by shard in its own layout."""
    from tfllm.checkpoint.shards import assign_blocks, target_blocks, tf_variable
    for name, var in variables.items():
        v = tf_variable(var, name)
        full = reference_value(name, tuple(v.shape), v.dtype.as_numpy_dtype)
        arrays = {block: full[tuple(slice(s, s + n) for s, n in zip(*block))]
                  for _, block in target_blocks(v)}
        assign_blocks(v, arrays)


def build_state(overrides, parallel):
    """The tiny model's run-state variables (model + AdamW) on `parallel`."""
    from tfllm.checkpoint import run_state_variables
    from tfllm.config import load_config
    from tfllm.models import build_model
    from tfllm.optim import AdamW
    cfg = load_config(None, overrides)
    model = build_model(cfg.model, cfg.precision, cfg.lora, parallel=parallel, seed=cfg.train.seed)
    optimizer = AdamW(cfg.optimizer, cfg.train.steps, parallel)
    optimizer.build(model.trainable_variables)
    return run_state_variables(model, optimizer)


def main(directory: str, overrides_json: str) -> None:
    sys.path.insert(0, ROOT)
    from tensorflow.experimental import dtensor

    from tfllm.checkpoint import Checkpointer
    from tfllm.config import load_config
    from tfllm.parallel import make_parallel
    overrides = json.loads(overrides_json)
    parallel = make_parallel(load_config(None, overrides).mesh)
    variables = build_state(overrides, parallel)
    fill_reference(variables)
    ckpt = Checkpointer(directory, parallel)
    ckpt.save(7, variables, metadata={"note": "multiclient"},
              client_files={"iterator.json": json.dumps({"client": ckpt.client_id}).encode()})
    ckpt.wait()
    print(json.dumps({"client_id": dtensor.client_id(), "num_clients": dtensor.num_clients(),
                      "checkpointer": [ckpt.client_id, ckpt.num_clients],
                      "local_devices": len(parallel.mesh.local_devices())}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
