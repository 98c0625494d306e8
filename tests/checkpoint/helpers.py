"""Shared setup for the checkpoint tests: tiny run states on any mesh, gathered values."""

import numpy as np

from tfllm.data import feed
from tfllm.checkpoint import run_state_variables
from tfllm.checkpoint.shards import tf_variable
from tfllm.data import SyntheticTokens
from tfllm.parallel import make_parallel
from tfllm.parallel.placement import to_numpy
from tfllm.precision.loss_scale import DynamicLossScale
from tfllm.train.state import build_train_state
from tests.harness import tiny_config


def build_run(axes, train_steps=0, family="gpt", **extra):
    """(config, parallel, variables) of a tiny run; `axes=None`: one device, no DTensor.

    With train_steps > 0 the optimizer states and counter are non-zero, as in a real
    resume. The loss scale (replicated scalars) is included to cover int64/scalar state.
    """
    cfg = tiny_config(family, axes or "data=1", **extra)
    parallel = None if axes is None else make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    state = build_train_state(cfg, parallel, jit_compile=False)
    model, optimizer, step = state.model, state.optimizer, state.step
    loss_scale = DynamicLossScale(2.0 ** 10, 100, parallel)
    if train_steps:
        data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=3)
        t = cfg.train
        for i in range(train_steps):
            step(feed.to_device(parallel, data.batch(i, t.global_batch_size,
                                                     t.grad_accum_steps)))
        loss_scale.scale.assign(loss_scale.scale * 3.0)  # a non-default value
    return cfg, parallel, run_state_variables(model, optimizer, loss_scale)


def gathered(variables):
    """{name: global numpy value} (whole arrays, gathered from the local shards)."""
    return {name: to_numpy(tf_variable(v, name)) for name, v in variables.items()}


def assert_same(actual: dict, expected: dict) -> None:
    """Bit-identical values (checkpoints copy bytes; no tolerance applies)."""
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)
