"""The step-time model of a plan (tfllm.plan.timing): pure arithmetic, no compile."""

import pytest

from tfllm.compiler.targets import get_target
from tfllm.plan import timing

H100 = get_target("h100")


def test_each_factor_adds_what_its_constant_says():
    result = {"roofline_s": 1.0, "roofline_gemm_s": 0.6, "kernel_launches": 1000,
              "collectives": {"bytes_per_device": 45e9, "link_bandwidth": 450e9}}
    t = timing.step_time(result, H100, clusters=101, collective_count=100)
    assert t["gemm_s"] == pytest.approx(0.6 / timing.GEMM_EFFICIENCY)
    assert t["other_s"] == pytest.approx(0.4)
    assert t["launch_s"] == pytest.approx(1000 * timing.KERNEL_GAP_S)
    assert t["dispatch_s"] == pytest.approx(100 * timing.CLUSTER_DISPATCH_S)
    # Hockney: a latency per collective plus the bytes at the bus bandwidth
    assert t["collective_s"] == pytest.approx(0.1 + 100 * timing.NCCL_LATENCY_S)
    # no blocks named: nothing is prefetched, every collective second is waited for
    assert t["exposed_collective_s"] == pytest.approx(t["collective_s"])
    # no blocks: the device waits one cluster's dispatch after each collective, and the
    # host's 2 ms of dispatch fit in the 1.3 s of compute
    assert t["exposed_dispatch_s"] == pytest.approx(100 * timing.CLUSTER_DISPATCH_S)
    assert t["step_s"] == pytest.approx(t["gemm_s"] + t["other_s"] + t["launch_s"]
                                        + t["exposed_dispatch_s"] + t["exposed_collective_s"])


def test_the_sharded_adamw_update_replaces_the_no_mesh_programs():
    params = 6.74e9  # llama-7b
    full = timing.adamw_seconds(params, H100.memory_bandwidth)
    # 28 bytes per parameter at 3.35 TB/s: the ~56 ms issue 35 names for llama-7b
    assert full == pytest.approx(0.0563, rel=0.01)
    result = {"roofline_s": 0.5, "roofline_gemm_s": 0.3, "kernel_launches": 0,
              "optimizer_update": {"program_s": full, "layout_s": full / 8}}
    t = timing.step_time(result, H100)
    assert t["other_s"] == pytest.approx(0.2 - full * 7 / 8)


def test_prefetched_block_collectives_hide_behind_a_neighbours_compute():
    exposed = timing.exposed_collective_seconds
    # 32 blocks, 0.32 s of compute (10 ms a block): 3.2 ms of collectives a block hide
    # whole behind the neighbour's 10 ms, except the first block's
    assert exposed(0.1024, 0.32, 32, True) == pytest.approx(0.1024 / 32)
    # 20 ms of collectives a block: 10 ms of each hidden, the first block's 20 exposed
    assert exposed(0.64, 0.32, 32, True) == pytest.approx(0.02 + 31 * 0.01)
    # never more than all of them, never less than one block's share
    for comm, compute in ((0.1, 0.0), (0.1, 10.0), (5.0, 0.3)):
        assert comm / 32 - 1e-12 <= exposed(comm, compute, 32, True) <= comm + 1e-12
    # tensor or sequence parallelism, or one block: all exposed
    assert exposed(0.1, 10.0, 32, False) == 0.1 and exposed(0.1, 10.0, 1, True) == 0.1


def test_a_plan_with_prefetched_blocks_exposes_less_than_one_without():
    base = {"roofline_s": 0.4, "roofline_gemm_s": 0.3, "kernel_launches": 1000,
            "collectives": {"bytes_per_device": 45e9, "link_bandwidth": 450e9}}
    flat = timing.step_time(base, H100, clusters=101, collective_count=100)
    fsdp = timing.step_time({**base, "blocks": 32, "overlappable": True}, H100,
                            clusters=101, collective_count=100)
    tp = timing.step_time({**base, "blocks": 32, "overlappable": False}, H100,
                          clusters=101, collective_count=100)
    assert tp["step_s"] == flat["step_s"]
    assert fsdp["exposed_collective_s"] == pytest.approx(flat["collective_s"] / 32)
    assert fsdp["exposed_dispatch_s"] == pytest.approx(flat["dispatch_s"] / 32)
    assert fsdp["step_s"] == pytest.approx(
        flat["step_s"] - flat["collective_s"] * 31 / 32
        - (flat["exposed_dispatch_s"] - fsdp["exposed_dispatch_s"]))
    assert fsdp["factors"]["overlap"] == "prefetched by block"


def test_the_host_dispatches_ahead_of_the_device_except_after_a_collective():
    exposed = timing.exposed_dispatch_seconds
    # llama-7b fsdp=8's shape: 32 blocks, 10 ms of compute and 3.3 ms of gathers a
    # block, 1.4 ms of dispatch a block: gather + dispatch fit in the neighbour's
    # compute, only the first block's dispatch is waited for
    assert exposed(0.0448, 0.32, 0.1056, 32, True, 136) == pytest.approx(0.0448 / 32)
    # 9 ms of gathers a block: 9 + 1.4 > 10, the 0.4 ms beyond is waited for per block
    assert exposed(0.0448, 0.32, 0.288, 32, True, 136) == pytest.approx(
        0.0014 + 31 * 0.0004)
    # gathers alone longer than the compute: their excess is already exposed as
    # collectives, the dispatch after them adds its whole share per block
    assert exposed(0.0448, 0.32, 0.64, 32, True, 136) == pytest.approx(0.0448)
    # collectives on the critical path: one cluster's dispatch after each of them ...
    assert exposed(0.0448, 0.32, 0.1, 32, False, 136) == pytest.approx(
        136 * timing.CLUSTER_DISPATCH_S)
    # ... and whatever host time exceeds the compute; never more than all of it
    assert exposed(0.5, 0.32, 0.1, 32, False, 10) == pytest.approx(
        10 * timing.CLUSTER_DISPATCH_S + 0.18)
    assert exposed(0.5, 0.0, 0.1, 32, False, 10) == 0.5
    assert exposed(0.0, 0.32, 0.1, 32, True, 10) == 0.0
    for args in ((0.05, 0.3, 0.1, 32, True, 100), (0.05, 0.01, 0.3, 32, True, 100),
                 (0.05, 0.3, 0.1, 1, True, 100), (0.05, 0.3, 0.1, 32, False, 5000)):
        assert 0.0 <= exposed(*args) <= args[0] + 1e-12
