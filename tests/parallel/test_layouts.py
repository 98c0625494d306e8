"""Actual variable layouts against checked-in golden tables, and placement properties."""

import json
import math
import os

import numpy as np
import pytest
from tensorflow.experimental import dtensor

from tfllm.checkpoint import state_name
from tfllm.models import build_model
from tfllm.optim import AdamW
from tfllm.parallel import make_parallel
from tfllm.parallel.layouts import layout_rows
from tfllm.parallel.placement import to_numpy
from tests.harness import sections, tiny_config

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
CASES = [("gpt", "data=2,fsdp=2,model=2"), ("llama", "data=2,fsdp=2,model=2"),
         ("gpt", "model=8"), ("llama", "fsdp=8")]


def _specs(tensor):
    return [None if s == dtensor.UNSHARDED else s
            for s in dtensor.fetch_layout(tensor).sharding_specs]


def _build(family, axes, zero1=True):
    cfg = tiny_config(family, axes, **{
        "optimizer.shard_optimizer_state": str(zero1).lower()})
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    model = build_model(*sections(cfg), parallel=parallel)
    optimizer = AdamW(cfg.optimizer, 3, parallel)
    optimizer.build(model.trainable_variables)
    return cfg, parallel, model, optimizer


@pytest.mark.parametrize("family, axes", CASES)
def test_actual_layouts_match_golden_table(family, axes, update_golden):
    cfg, parallel, model, optimizer = _build(family, axes)
    actual = {v.path: _specs(v.value) for v in model.variables}
    for var, (_, m, v) in zip(optimizer.variables, optimizer.states):
        actual[state_name("optimizer/m", var.path)] = _specs(m)
        actual[state_name("optimizer/v", var.path)] = _specs(v)
    path = os.path.join(GOLDEN, f"layouts_{family}_{axes.replace(',', '_').replace('=', '')}.json")
    if update_golden:
        with open(path, "w") as f:
            json.dump(actual, f, indent=1, sort_keys=True)
    with open(path) as f:
        golden = json.load(f)
    assert actual == golden, f"layouts differ from {path}; rerun with --update-golden if intended"
    # The table `tfllm layouts` prints (computed without devices) agrees with reality.
    rows = layout_rows(model, parallel.rules, parallel.shape, zero1=True)
    for row in rows:
        assert list(row.spec) == actual[row.path], row.path
        assert list(row.optimizer_spec) == actual[state_name("optimizer/m", row.path)], row.path


@pytest.mark.parametrize("family, axes", CASES[:2])
def test_no_weight_is_materialized_whole(family, axes):
    cfg, parallel, model, optimizer = _build(family, axes)
    for var in model.variables:
        spec = parallel.variable_spec(var)
        shards = math.prod(parallel.shape[m] for m in spec if m)
        for part in dtensor.unpack(var.value.read_value()):
            assert part.shape.num_elements() * shards == math.prod(var.shape), var.path
    # Every trainable variable is a DTensor variable, and so is every optimizer state.
    assert all(isinstance(v.value, dtensor.DVariable) for v in model.variables)
    assert all(isinstance(s, dtensor.DVariable) for s in optimizer.state_variables())


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_initial_values_do_not_depend_on_the_mesh(family):
    reference = build_model(*sections(tiny_config(family)))
    want = {v.path: to_numpy(v) for v in reference.variables}
    for axes in ("data=2,fsdp=2,model=2", "fsdp=8", "model=8"):
        _, _, model, _ = _build(family, axes, zero1=False)
        for v in model.variables:
            np.testing.assert_array_equal(to_numpy(v), want[v.path], err_msg=f"{axes} {v.path}")


def test_initial_values_have_the_configured_statistics():
    cfg = tiny_config("llama")
    model = build_model(*sections(cfg))
    for v in model.variables:
        w = to_numpy(v)
        if v.init[0] == "normal":
            std = v.init[1]
            # 1e4 samples: the sample std is within 3% of the target with high probability.
            assert abs(w.std() / std - 1) < 0.05, v.path
            assert abs(w.mean()) < 5 * std / math.sqrt(w.size), v.path
        else:
            assert np.all(w == (1.0 if v.init[0] == "ones" else 0.0)), v.path
    other = build_model(*sections(cfg), seed=cfg.train.seed + 1)
    assert not np.array_equal(to_numpy(other.variables[0]), to_numpy(model.variables[0]))


def test_indivisible_heads_fail_before_allocating():
    from tfllm.parallel.rules import ShardingError
    cfg = tiny_config("llama", "model=8", **{
        "model.num_key_value_heads": 4})
    with pytest.raises(ShardingError, match=r"llama/block_0/attention/key/kernel: dimension 1 "
                                            r"\('kv_heads', size 4\) is not divisible by mesh "
                                            r"axis 'model' \(size 8\)"):
        build_model(*sections(cfg), parallel=make_parallel(cfg.mesh, cfg.model, cfg.optimizer))


def test_a_replicated_value_is_copied_to_the_host_from_one_device(monkeypatch):
    # A step's metrics are replicated scalars: reading every local device's copy cost one
    # device-to-host transfer per metric per device at every step.
    from types import SimpleNamespace
    from tfllm.parallel import placement
    copies = []

    class Part:
        def numpy(self):
            copies.append(1)
            return np.float32(2.5)

    fake = SimpleNamespace(
        is_dtensor=lambda x: True, UNSHARDED=placement.dtensor.UNSHARDED,
        fetch_layout=lambda x: SimpleNamespace(sharding_specs=[]),
        unpack=lambda x: [Part() for _ in range(8)])
    monkeypatch.setattr(placement, "dtensor", fake)
    assert placement.to_numpy(object()) == 2.5 and copies == [1]
