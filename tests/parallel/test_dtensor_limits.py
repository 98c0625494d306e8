"""What TensorFlow 2.21's DTensor allows an op it has no SPMD rule for (issue 34, item 1).

benchmarks/dtensor_per_device_probe.py tries every route for running such an op (a
fused-attention custom call, here an `XlaCallModule` that runs on the CPU) on each
device's local shards inside a step; docs/design.md's "Fused (cuDNN) attention on a DTensor
mesh" explains the findings. This test holds them: when a TensorFlow upgrade opens a
route, an outcome changes and it fails, which is the signal to build `model.attention=cudnn`.
"""

import importlib.util
import json
import subprocess

import pytest

from tests.harness import PY, ROOT, TF_HANG_S, tfllm_env

pytestmark = [
    pytest.mark.slow,  # two fresh processes importing TensorFlow and jax: ~40 s on 2 cores
    pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                       reason='needs the plan extra (jax exports the module): pip install -e ".[plan]"'),
]


def test_no_route_lets_a_step_use_an_op_run_per_device():
    result = subprocess.run([PY, "benchmarks/dtensor_per_device_probe.py"], cwd=ROOT,
                            env=tfllm_env(), capture_output=True, text=True, timeout=TF_HANG_S)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout[result.stdout.index("{"):])
    message = {route: o.get("message", "") for route, o in outcomes.items()}
    # Refused outright.
    assert not outcomes["plain"]["ok"]
    assert "'tf.XlaCallModule' op does not implement layout propagation" in message["plain"]
    # Replicated: right values, but every device holds (and computed) the global result.
    replicated = outcomes["replicated"]
    assert replicated["ok"] and replicated["max_error"] < 1e-5, replicated  # float32 sums
    assert replicated["layout"] == "sharding_specs:unsharded,unsharded,unsharded,unsharded"
    assert replicated["local_shape"] == [4, 8, 8, 4]  # the global (B, T, H, D)
    # Parted: the op's output gets its shard's shape (2 of 8 heads), which every later op,
    # relayouts included, reads as the global shape.
    for route in ("parted_pinned", "parted_to_sharded"):
        assert not outcomes[route]["ok"]
        assert "dimension size=2 is not divisible by number of shards" in message[route]
    assert not outcomes["parted_then_step"]["ok"]
    assert "'tf.Reshape' op requires 'output' number of elements to match" in message[
        "parted_then_step"] and "got 1024 and 128" in message["parted_then_step"]
    # XLA's own SPMD partitioner: TPU meshes only.
    assert "XLA SPMD is not currently not supported for CPU mesh" in message["xla_spmd"]
