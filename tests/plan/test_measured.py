"""Measured collectives of a sharded plan (`tfllm.plan.measured`): a tiny step of the same
mesh run on CPU devices in a child process, classified and scaled to the planned model.
No jax needed: nothing is compiled for a GPU here."""

import functools
import math
import os

import pytest

from tfllm.compiler.targets import get_target
from tfllm.config import load_config
from tfllm.footprint import layout as footprint
from tfllm.plan import measured, sharded
from tfllm.plan.planner import format_plan
from tests.harness import ROOT, tiny_config


def tiny(axes, **extra):
    return tiny_config("llama", axes, **{"precision.policy": "bfloat16",
                                          **extra})


def test_tiny_weight_kinds_have_distinct_sizes_and_scale_to_the_model():
    config = tiny("data=2,model=2")
    shape = footprint.mesh_shape(config)
    t = measured.tiny_config(config, 2, shape)
    assert t.mesh.axes == "data=2,model=2" and t.precision.policy == "bfloat16"
    sc = measured.scales(config, t, shape)
    kinds = {kind for kind, _ in sc["weights"].values()}
    # q/o, k/v, gate/up/down, embedding/lm head, norms: one size each (per compute layout);
    # and the buffers blocks move their weights in (tfllm.parallel.blocks)
    weights = [kind for kind, _ in sc["weights"].values()
               if kind != "block" and not kind.endswith("(whole)")]
    assert len(weights) == 5 and "llama/block/attention/key/kernel" in kinds
    # the embedding split over model also travels whole: its gradient, summed over the
    # whole vocabulary and reduced over the batch axes
    assert "llama/token_embedding/embeddings (whole)" in kinds
    assert "block" in kinds
    # a weight count is that weight; tokens x hidden an activation; <= 1024 small
    size, (kind, s) = next(iter(sc["weights"].items()))
    assert measured.classify(size, sc) == (f"weight {kind}", s)
    assert measured.classify(sc["tokens"] * t.model.hidden_dim, sc)[0] == "activation"
    assert measured.classify(1, sc)[0] == "small"


def test_the_tiny_step_splits_its_gradient_buckets_like_the_real_block():
    config = load_config(os.path.join(ROOT, "configs", "llama-7b.yaml"), ["mesh.axes=fsdp=8"])
    shape = footprint.mesh_shape(config)
    t = measured.tiny_config(config, 2, shape)
    block = lambda c: max(u.reduced for u in footprint.mesh_plan(c, 8).units  # noqa: E731
                          if u.name.startswith("block_"))
    # llama-7b's block (202M float32 gradients, 773 MiB) spans ~31 buckets of 25 MiB:
    # the tiny block's bucket is as small a share of it
    assert block(config) * 4 / 2**20 / config.mesh.gradient_bucket_mb > 30
    assert t.mesh.gradient_bucket_mb / config.mesh.gradient_bucket_mb == pytest.approx(
        block(t) / block(config))


def test_the_tiny_width_divides_every_axis_and_stays_small_on_large_meshes():
    # llama-70b's fsdp=16,model=8: 24 x 16, not 24 x 128 (3,072 wide, ~200M parameters a
    # layer, more than a 23 GiB host ran on 128 CPU devices)
    config = load_config(os.path.join(ROOT, "configs", "llama-70b.yaml"))
    shape = footprint.mesh_shape(config)
    t = measured.tiny_config(config, 1, shape)
    assert t.model.hidden_dim == 24 * 16
    m = t.model
    for width in (m.hidden_dim, m.intermediate_dim, m.vocab_size,
                  m.num_query_heads * m.head_dim, m.num_key_value_heads * m.head_dim):
        assert all(width % size == 0 for size in shape.values())
    assert footprint.mesh_plan(t, 128).units  # the rules lay every weight out


# Two 1-layer tiny steps without XLA (the collectives are the same): ~1-2 min.
@pytest.mark.slow
def test_scaled_collectives_do_not_depend_on_the_tiny_width(monkeypatch):
    # data x fsdp splits the sequence: its activations' gradients are reduced over the
    # gathered sequence (8 x tokens x hidden on data=2,fsdp=4), once scaled as weights
    config = load_config(os.path.join(ROOT, "configs", "llama-1b.yaml"),
                         ["mesh.axes=data=2,fsdp=4"])
    shape = footprint.mesh_shape(config)
    totals = []
    for unit in (4, 8):  # tiny widths 96 and 192
        monkeypatch.setattr(measured, "tiny_width", lambda s, u=unit: 24 * u)
        run = measured.run_tiny(config, shape, layers=(1,), jit_compile=False)[1]
        tiny = measured.tiny_config(config, 1, shape)
        scaled = measured.scaled_collectives(run["collectives"],
                                             measured.scales(config, tiny, shape), shape)
        by_class = {}
        for (_, _, carries), g in scaled.items():
            by_class[carries] = by_class.get(carries, 0) + g["bytes"]
        totals.append(by_class)
    assert totals[0]["activation"] > 0
    # the same classes and bytes at either width: merged buffers are padded to 1024
    # elements (a tiny share of either), small ones scale as an upper bound
    assert set(totals[0]) == set(totals[1])
    for carries, n in totals[0].items():
        if carries != "small":
            assert n == pytest.approx(totals[1][carries], rel=0.01), carries


def _sharded_elements(config, shape):
    rows = footprint.mesh_plan(config, math.prod(shape.values())).rows
    return {r.path: math.prod(r.shape) for r in rows
            if r.optimizer_bytes_per_device and any(a for a in r.spec)}


# Each measure runs two tiny steps (1 and 2 layers) in a child process: ~40-80 s.
@pytest.mark.slow
def test_fsdp_gathers_every_sharded_weight_twice_in_bf16_and_reduce_scatters_float32():
    config = tiny("fsdp=4")
    shape = footprint.mesh_shape(config)
    m = measured.measure(config, shape, 450e9)
    groups = {(g["kind"], g["dtype"], g["carries"]): g for g in m["groups"]}
    weights = _sharded_elements(config, shape)
    embedding = weights["llama/token_embedding/embeddings"]
    total = sum(weights.values())
    # bf16 travels as float16 bits, gathered forward and again backward; the embedding's
    # lookup needs no weight in its backward, so it is gathered once. Counts are exact:
    # a CollectiveGatherV2 is not merged or padded.
    gathers = groups[("all-gather", "float16", "weights")]
    assert gathers["elements"] == pytest.approx(2 * total - embedding)
    assert gathers["bytes"] == pytest.approx(2 * (2 * total - embedding))
    assert gathers["sent"] == pytest.approx(3 / 4 * gathers["bytes"])
    # gradients: float32, one per sharded weight, a reduce-scatter under NCCL
    scatters = groups[("reduce-scatter", "float32", "weights")]
    # (one all-reduce per tensor since DTensor's combining is off: the replicated norm
    # scales' gradient all-reduces, 5 x hidden, are sized like weights and land here too)
    norms = 5 * 64
    assert total <= scatters["elements"] <= total + norms
    assert scatters["bytes"] == 4 * scatters["elements"]
    # nothing else but scalars and the replicated norms' gradients
    rest = [g for k, g in groups.items() if k[2] not in ("weights",)]
    assert all(g["carries"] == "small" for g in rest)
    assert "measured" in m["basis"]


@pytest.mark.slow
def test_data_and_model_move_float32_gradients_and_activations(monkeypatch):
    config = tiny("data=2,model=2")
    shape = footprint.mesh_shape(config)
    # Kinds and dtypes only: the executed graph's collectives are the same without XLA
    # (measured.run_tiny), which spares compiling every device's clusters twice.
    monkeypatch.setattr(measured, "run_tiny",
                        functools.partial(measured.run_tiny, jit_compile=False))
    m = measured.measure(config, shape, 450e9)
    carried = {(g["kind"], g["dtype"], g["carries"]) for g in m["groups"]}
    # DTensor upcasts bf16 reductions: the activations' all-reduces over model are float32
    assert ("all-reduce", "float32", "activation") in carried
    # the gradients over data: per weight or merged into padded buffers, float32
    assert carried & {("all-reduce", "float32", "weights"),
                      ("all-reduce", "float32", "merged gradients")}
    assert not any(k[1] == "bfloat16" for k in carried)
    # labelled beside the assumed figure when a plan carries both
    plan = footprint.mesh_plan(config)
    p = sharded.mesh_figures(config, plan, footprint.mesh_plan(plan.local),
                             get_target("h100"), measured=m)
    assert p.collectives.as_json() == m
    assert p.collectives_assumed.basis.startswith("assumed")
    assert p.collectives.seconds == m["seconds"]


def test_block_buffers_peak_when_the_last_block_reduces_its_gradients():
    config = tiny("fsdp=4")
    plan = footprint.mesh_plan(config)
    b = plan.buffers
    h, i, v = 64, 128, 128
    kernels = h * 16 * 4 * 2 + h * 8 * 4 * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    weights = kernels + 2 * h  # and the two norm scales, replicated: reduced, not gathered
    # the units that move together, in forward order: the embedding alone, each block,
    # the final norm with the head
    units = [(u.name, u.gathered, u.reduced) for u in plan.units]
    assert units == [("token_embedding", v * h, v * h), ("block_0", kernels, weights),
                     ("block_1", kernels, weights), ("final_norm + head", h * v, h * v + h)]
    # block_1's backward: block_0's prefetched bf16 re-gather, block_1's bf16 partial
    # gradients and its float32 reduce-scatter buffer
    assert b.unit == "block_1 backward"
    assert (b.gathered, b.partials, b.gradient) == (2 * kernels, 2 * weights, 4 * weights)
    assert b.bytes == 2 * kernels + 6 * weights
    # data parallelism gathers nothing but reduces each block's gradients from one
    # float32 buffer (buckets of at most mesh.gradient_bucket_mb, alive together)
    data = footprint.mesh_plan(tiny("data=4")).buffers
    assert (data.gathered, data.bytes) == (0, 6 * weights)
    # a mesh that does not split the batch has no blocks
    assert footprint.mesh_plan(tiny("model=4")).buffers.bytes == 0


def test_fp8_kernels_travel_in_bytes_and_frozen_kernels_travel_too():
    h, i = 64, 128
    kernels = h * 16 * 4 * 2 + h * 8 * 4 * 2 + 3 * h * i  # as above
    weights = kernels + 2 * h
    sent = {}
    for policy in ("bfloat16", "fp8"):
        config = tiny("fsdp=4", **{"precision.policy": policy})
        plan = footprint.mesh_plan(config)
        block = plan.units[1]
        assert (block.gathered, block.reduced) == (kernels, weights)
        # FP8 projections' kernels travel as bytes (tfllm.parallel.blocks + fp8's codec)
        assert block.gathered_8bit == (kernels if policy == "fp8" else 0)
        assert plan.units[0].gathered_8bit == 0  # the embedding stays 16-bit
        sent[policy] = sum(t.bytes for t in sharded.axis_traffic(plan, config))
    # the layout's formula: each block's kernels gather forward and backward (2 x ring
    # (n-1)/n) at one byte instead of two
    assert sent["bfloat16"] - sent["fp8"] == pytest.approx(
        2 * 3 / 4 * kernels * tiny("fsdp=4").model.num_layers)
    # LoRA: the frozen kernels travel in the block's gather, only the adapters reduce
    config = tiny("fsdp=4", **{"lora.rank": 4})
    block = footprint.mesh_plan(config).units[1]
    assert block.gathered >= kernels and block.reduced < kernels


def test_a_tied_head_gathers_the_embedding_table_again():
    config = tiny_config("gpt", "fsdp=4")
    units = footprint.mesh_plan(config).units
    table = units[0].gathered
    assert units[0].name == "token_embedding" and table > 0
    assert units[-1].gathered == table  # the final norm's scale and bias are replicated
    assert len(units) == config.model.num_layers + 2


# One tiny step with XLA on, in a child process (~30-60 s).
@pytest.mark.slow
def test_the_block_buffers_are_the_sizes_the_compiled_program_moves():
    config = tiny("fsdp=4")
    shape = footprint.mesh_shape(config)
    run = measured.run_tiny(config, shape, layers=(2,))[2]
    t = measured.tiny_config(config, 2, shape)
    plan = footprint.mesh_plan(t, math.prod(shape.values()))
    units = {u.name: u for u in plan.units}
    b = plan.buffers
    gathers = [c["elements"] for c in run["collectives"]
               if c["kind"] == "all-gather" and c["dtype"] == "float16"]
    reductions = [c["elements"] for c in run["collectives"]
                  if c["kind"] == "all-reduce" and c["dtype"] == "float32"]
    block = units["block_0"]
    # each block's sharded weights travel as one bf16 gather (float16 bits), forward and
    # again backward; its gradients as one float32 buffer (below mesh.gradient_bucket_mb),
    # the replicated norms' apart from the kernels
    assert gathers.count(block.gathered) == 2 * 2
    assert reductions.count(block.gathered) == 2
    # the buffers the memory model counts at its peak are those sizes
    assert b.gathered == 2 * block.gathered and b.gradient == 4 * block.reduced
    sc = measured.scales(config, t, shape)
    assert measured.classify(block.gathered, sc)[0] == "weight block"
    # XLA's clusters of the busiest device (what `tfllm plan` times the dispatch of)
    assert run["clusters"] > len(run["collectives"]) // 2 > 0


@pytest.mark.parametrize("stderr, hinted", [
    ("LLVM compilation error: Cannot allocate memory\n", True),
    ("ValueError: something else\n", False)])
def test_a_tiny_step_out_of_mappings_says_which_limit_to_raise(monkeypatch, tmp_path,
                                                               stderr, hinted):
    # llama-70b's 128-device tiny step failed in XLA's code generation this way with
    # 10 GB of host memory free: the process had run out of memory mappings
    import subprocess
    monkeypatch.setattr(measured.subprocess, "run", lambda *a, **k:
                        subprocess.CompletedProcess(a, 1, "", stderr))
    with pytest.raises(measured.MeasureError) as e:
        measured.run_tiny(tiny("fsdp=8"), {"fsdp": 8})
    first = str(e.value).splitlines()[0]
    assert first.startswith("the tiny step on 8 CPU devices failed:")
    assert ("vm.max_map_count" in first and "--collectives assumed" in first) == hinted
    assert stderr.strip() in str(e.value)  # the child's own words follow
    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")
    assert ("vm.max_map_count is 65,530" in measured._out_of_mappings(stderr, str(limit))
            ) == hinted


def test_a_proxy_mesh_shrinks_the_batch_axes_and_keeps_groups_apart():
    # llama-70b's preset: 128 devices measured on 16, each group counted at its real size
    assert measured.proxy_shape({"fsdp": 16, "model": 8}) == {"fsdp": 2, "model": 8}
    assert measured.group_sizes({"fsdp": 2, "model": 8}, {"fsdp": 16, "model": 8}) == {
        2: 16, 8: 8, 16: 128}
    assert measured.proxy_shape({"data": 16, "fsdp": 8}) == {"data": 2, "fsdp": 4}
    assert measured.proxy_shape({"fsdp": 8}) is None  # small enough to run as it is
    # data=2,fsdp=2 would give both axes' groups one size: no proxy tells them apart
    assert measured.group_sizes({"data": 2, "fsdp": 2}, {"data": 2, "fsdp": 16}) is None
    assert measured.proxy_shape({"data": 4, "fsdp": 16, "model": 8}) is None
    config = tiny("fsdp=8", **{"train.global_batch_size": 16})
    proxy = measured.proxy_config(config, {"fsdp": 8}, {"fsdp": 2})
    assert (proxy.mesh.axes, proxy.train.global_batch_size) == ("fsdp=2", 4)
    # a shrunk axis that does not split the batch would change the rows: refused
    with pytest.raises(measured.MeasureError, match="same rows"):
        measured.proxy_config(tiny("fsdp=4,model=2", **{"train.global_batch_size": 16}),
                              {"fsdp": 4, "model": 2}, {"fsdp": 4, "model": 1})


@pytest.mark.slow
def test_a_proxy_mesh_measures_what_the_mesh_itself_runs(monkeypatch):
    # fsdp=4 on 4 CPU devices, and on a proxy of 2 with the batch halved: the same
    # collectives, bytes and clusters (measured 2026-11-29 also for fsdp=8 against its
    # fsdp=2 proxy, and fsdp=8,model=2 against fsdp=4,model=2: the same)
    config = tiny("fsdp=4")  # the step the tests above run (one run per session)
    direct = measured.measure(config, {"fsdp": 4}, 450e9)
    monkeypatch.setattr(measured, "MAX_DEVICES", 2)
    proxy = measured.measure(config, {"fsdp": 4}, 450e9)
    assert "run on fsdp=2 (2 CPU devices" in proxy["basis"]
    assert (proxy["count"], proxy["clusters"]) == (direct["count"], direct["clusters"])
    rows = lambda r: {(g["kind"], g["dtype"], g["carries"]): g for g in r["groups"]}
    for key, g in rows(direct).items():
        p = rows(proxy)[key]
        assert p["count"] == g["count"]
        if key[2] == "small":  # scaled by the tiny width, an upper bound (module doc)
            assert p["sent"] == pytest.approx(g["sent"], rel=0.05)
        else:  # the same buffers at the same ring factor
            assert p["sent"] == pytest.approx(g["sent"], rel=1e-9)


def test_a_proxy_counts_a_gathered_activation_at_its_real_group():
    # an activation gathered over fsdp (DTensor: an all-reduce of the zero-padded group's
    # rows) holds the group's rows: on fsdp=8 twice what it holds on an fsdp=4 proxy;
    # a weight's gather holds the same weight whatever the group
    config = tiny("fsdp=4,model=2")
    shape = {"fsdp": 4, "model": 2}
    t = measured.tiny_config(config, 1, shape)
    sc = measured.scales(config, t, shape)
    rows = sc["tokens"] * t.model.hidden_dim * 4  # a group of 4 devices' rows
    block = next(n for n, (kind, _) in sc["weights"].items() if kind == "block")
    collectives = [
        {"kind": "all-reduce", "dtype": "float32", "elements": rows, "itemsize": 4,
         "group_size": 4, "dtensor_op": "all-gather"},
        {"kind": "all-gather", "dtype": "float16", "elements": block, "itemsize": 2,
         "group_size": 4, "dtensor_op": "all-gather"}]
    groups = measured.group_sizes(shape, {"fsdp": 8, "model": 2})
    as_run = measured.scaled_collectives(collectives, sc, shape)
    on_real = measured.scaled_collectives(collectives, sc, shape, groups)
    act = ("all-reduce", "float32", "activation")
    weights = ("all-gather", "float16", "weights")
    assert on_real[act]["elements"] == 2 * as_run[act]["elements"]
    assert on_real[act]["sent"] == pytest.approx(2 * 7 / 8 * on_real[act]["bytes"])
    assert on_real[weights]["elements"] == as_run[weights]["elements"]
    assert on_real[weights]["sent"] == pytest.approx(7 / 8 * on_real[weights]["bytes"])


@pytest.mark.slow
def test_a_proxy_of_a_tensor_parallel_mesh_measures_what_the_mesh_runs(monkeypatch):
    # fsdp=8,model=2 on 16 CPU devices and on its fsdp=4,model=2 proxy, without XLA (the
    # same collectives, ~1.5 min in all): the same counts and bytes but the small ones
    # (scaled by the tiny width). It found the embedding's gradient, summed over the
    # whole vocabulary, scaled as an activation: 2.4x its bytes, 3x apart on the proxy
    monkeypatch.setattr(measured, "run_tiny",
                        functools.partial(measured.run_tiny, jit_compile=False))
    config = tiny("fsdp=8,model=2")
    shape = {"fsdp": 8, "model": 2}
    direct = measured.measure(config, shape, 450e9)
    monkeypatch.setattr(measured, "MAX_DEVICES", 8)
    proxy = measured.measure(config, shape, 450e9)
    assert "run on fsdp=4,model=2" in proxy["basis"] and direct["count"] == proxy["count"]
    rows = lambda r: {(g["kind"], g["dtype"], g["carries"]): g for g in r["groups"]}
    assert rows(direct).keys() == rows(proxy).keys()
    for key, g in rows(direct).items():
        p = rows(proxy)[key]
        assert p["count"] == g["count"]
        assert p["sent"] == pytest.approx(g["sent"], rel=0.2 if key[2] == "small" else 1e-9)
    assert rows(direct)[("reduce-scatter", "float32", "weights")]["count"] == 5
