"""Save/restore timings (not a test): python tests/checkpoint/bench.py [tiny|5m] ...

Builds the model + AdamW on data=2,model=4 (8 logical CPU devices), then times a sync
save (after a warm-up save), an async save (time until save() returns, and until wait() returns), a restore on
the same mesh and a restore onto fsdp=8.
"""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tests.conftest  # noqa: E402,F401  (8 logical CPU devices)
from tests.checkpoint.helpers import build_run  # noqa: E402
from tfllm.checkpoint import Checkpointer  # noqa: E402
from tfllm.config.schema import CheckpointConfig  # noqa: E402

SIZES = {
    "tiny": {},
    "5m": {"model.vocab_size": 8192, "model.hidden_dim": 256, "model.num_layers": 4,
           "model.num_query_heads": 8, "model.intermediate_dim": 1024},
}


def bench(size: str) -> dict:
    _, parallel, variables = build_run("data=2,model=4", **SIZES[size])
    params = sum(int(__import__("numpy").prod(v.shape)) for n, v in variables.items()
                 if n.startswith("model/"))
    out = {"size": size, "model_params": params}
    with tempfile.TemporaryDirectory() as d:
        sync = Checkpointer(os.path.join(d, "s"), parallel)
        t = time.perf_counter()
        sync.save(0, variables)  # the first DTensor reads/unpacks warm up (~1-2 s once)
        out["first_save_s"] = time.perf_counter() - t
        t = time.perf_counter()
        sync.save(1, variables)
        out["sync_save_s"] = time.perf_counter() - t
        out["bytes"] = sum(os.path.getsize(os.path.join(r, f))
                           for r, _, fs in os.walk(os.path.join(d, "s", "step_00000001")) for f in fs)
        asyn = Checkpointer(os.path.join(d, "a"), parallel, CheckpointConfig(async_save=True))
        t = time.perf_counter()
        asyn.save(1, variables)
        out["async_save_returns_s"] = time.perf_counter() - t
        asyn.wait()
        out["async_save_done_s"] = time.perf_counter() - t
        t = time.perf_counter()
        sync.restore_latest(variables)
        out["restore_same_mesh_s"] = time.perf_counter() - t
        _, p2, target = build_run("fsdp=8", **SIZES[size])
        t = time.perf_counter()
        Checkpointer(os.path.join(d, "s"), p2).restore_latest(target)
        out["restore_fsdp8_s"] = time.perf_counter() - t
    return out


if __name__ == "__main__":
    for s in sys.argv[1:] or ["tiny", "5m"]:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in bench(s).items()}), flush=True)
