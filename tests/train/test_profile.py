"""train.profile_steps: a TensorFlow profiler trace of the chosen steps, and its summary."""

import pytest

from tfllm.cli.main import main
from tfllm.config import ConfigError, load_config
from tfllm.train.profile import summary, trace_files


@pytest.mark.slow
def test_profile_steps_writes_a_trace_of_those_steps_that_summary_reads(tmp_path, capsys):
    workdir = tmp_path / "run"
    assert main(["train", "--config", "configs/tiny.yaml", "--workdir", str(workdir),
                 "--set", "mesh.axes=fsdp=2,model=2", "--set", "train.steps=4",
                 "--set", "model.family=llama",
                 "--set", "train.log_every=4", "--set", "train.eval_every=0",
                 "--set", "train.profile_steps=2-3", "--set", "train.xla_cache=off"]) == 0
    out = capsys.readouterr().out
    assert f"profile of steps 2-3 in {workdir}/tensorboard" in out
    files = trace_files(str(workdir / "tensorboard"))
    assert len(files) == 1  # one trace: steps 2..3
    planes = summary(str(workdir / "tensorboard"))["planes"]
    host = next(p for name, p in planes.items() if "host" in name.lower())
    names = [name for name, _, _ in host["top"]]
    # The step ran inside the trace: its TF function (two calls) is among the host's
    # heaviest events. Which of its events ranks first varies: the executor's
    # `EagerLocalExecute: __inference__train_step...` counts once per device of the mesh
    # (8 = 2 steps x 4 devices on CI), the function's own `_train_step` once per call.
    step = [(name, n) for name, _, n in host["top"] if "train_step" in name]
    assert any(name == "_train_step" and n == 2 for name, n in step), (names, step)
    assert all(n % 2 == 0 for _, n in step), step  # steps 2 and 3 alike, no third step
    # fsdp=2: the blocks' gathers and reductions ran, 2 steps' worth
    collectives = host["collectives"]
    assert collectives["count"] > 0 and collectives["count"] % 2 == 0
    assert all("Collective" in name for name, _, _ in collectives["top"])
    assert any("block_0_gather" in name for name, _, _ in collectives["top"]) or any(
        "CollectiveGatherV2" in name for name, _, _ in collectives["top"])
    # Communication hidden behind compute, as the CPU executor's threads allow (the
    # number is printed by `tfllm profile`; on GPUs it is the NCCL stream's overlap).
    assert 0 <= collectives["overlapped_ms"] <= collectives["ms"]
    print("overlapped", collectives["overlapped_ms"], "of", collectives["ms"], "ms")


def test_summary_reads_the_memory_peak_of_allocator_events(tmp_path):
    # TF's plain CPU allocator (the tests turn oneDNN's off) traces no allocations; GPU
    # and oneDNN allocators do. An XSpace as they write it: the peak is the most bytes
    # held after any allocation, with the op that reached it.
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/device:GPU:0")
    plane.event_metadata[1].name = "MemoryAllocation"
    plane.event_metadata[2].name = "fusion.3"
    for key, name in enumerate(("bytes_allocated", "allocator_name", "tf_op"), start=1):
        plane.stat_metadata[key].name = name
    plane.stat_metadata[9].name = "GPU_0_bfc"  # allocator names are referenced stats
    line = plane.lines.add(name="allocations")
    for held, op in ((1000, "a/MatMul"), (5000, "b/Einsum"), (3000, "c/Add")):
        event = line.events.add(metadata_id=1, duration_ps=0)
        event.stats.add(metadata_id=1, uint64_value=held)
        event.stats.add(metadata_id=2, ref_value=9)
        event.stats.add(metadata_id=3, str_value=op)
    line.events.add(metadata_id=2, duration_ps=2_000_000_000)  # 2 ms of compute
    path = tmp_path / "t.xplane.pb"
    path.write_bytes(space.SerializeToString())
    gpu = summary(str(path))["planes"]["/device:GPU:0"]
    assert gpu["memory"] == {"peak_bytes": 5000, "peak_allocator": "GPU_0_bfc",
                             "peak_op": "b/Einsum", "allocations": 3}
    assert gpu["top"][0][:2] == ("fusion.3", 2.0) and gpu["collectives"]["count"] == 0


def test_summary_measures_how_much_communication_overlaps_compute(tmp_path):
    # A gather from 1 to 4 ms on the NCCL stream while a matmul kernel runs from 3 to 8 ms
    # on the compute stream, and an all-reduce from 9 to 10 ms with nothing beside it:
    # 1 ms of the 4 ms of communication is hidden. Function-call events do not count as
    # compute (they span everything).
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/device:GPU:0")
    for key, name in enumerate(("ncclAllGather", "ncclAllReduce", "gemm_fusion",
                                "step:StatefulPartitionedCall"), start=1):
        plane.event_metadata[key].name = name
    ms = 1_000_000_000  # picoseconds
    nccl = plane.lines.add(name="nccl", timestamp_ns=0)
    nccl.events.add(metadata_id=1, offset_ps=1 * ms, duration_ps=3 * ms)
    nccl.events.add(metadata_id=2, offset_ps=9 * ms, duration_ps=1 * ms)
    compute = plane.lines.add(name="compute", timestamp_ns=0)
    compute.events.add(metadata_id=3, offset_ps=3 * ms, duration_ps=5 * ms)
    host = plane.lines.add(name="calls", timestamp_ns=0)
    host.events.add(metadata_id=4, offset_ps=0, duration_ps=11 * ms)
    path = tmp_path / "t.xplane.pb"
    path.write_bytes(space.SerializeToString())
    collectives = summary(str(path))["planes"]["/device:GPU:0"]["collectives"]
    assert collectives["count"] == 2 and collectives["ms"] == 4.0
    assert collectives["overlapped_ms"] == 1.0


@pytest.mark.parametrize("value", ["0-2", "3-2", "x", "1-2-3", "9"])
def test_a_malformed_profile_range_is_one_line(value):
    with pytest.raises(ConfigError, match="train.profile_steps"):
        load_config(None, [f"train.profile_steps={value}", "train.steps=8"])
