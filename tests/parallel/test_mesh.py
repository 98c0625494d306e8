import os

import pytest

from tfllm.parallel import mesh
from tfllm.runtime import devices

from tfllm.contracts import num_clients
from tfllm.parallel.mesh import MeshError, parse_axes, resolve_axes
from tfllm.parallel.rules import DEFAULT_RULES, candidate_axis, check_batch


def test_parse_and_fill():
    assert parse_axes("data=2, fsdp=2,model=2") == [("data", 2), ("fsdp", 2), ("model", 2)]
    assert resolve_axes(parse_axes("data=-1,model=2"), 8) == [("data", 4), ("model", 2)]


@pytest.mark.parametrize("text, message", [
    ("", "empty"), ("data", "is not name=size"), ("data=0", "has size 0"),
    ("data=2,data=4", "given twice"), ("pipeline=2", "unknown axis 'pipeline'"),
    ("data=-1,model=-1", "only one axis may be -1"),
    ("expert=4,model=2", "no 'expert' axis; the experts split over the axis that carries "
                         "the batch's rows .* expert=4 -> data=4 or fsdp=4"),
])
def test_parse_errors(text, message):
    with pytest.raises(MeshError, match=message):
        parse_axes(text)


def test_size_mismatch_errors():
    with pytest.raises(MeshError, match="the mesh has 4 devices but 8 are available"):
        resolve_axes(parse_axes("data=2,model=2"), 8)
    with pytest.raises(MeshError, match="not divisible by the fixed axes' product 3"):
        resolve_axes(parse_axes("data=-1,model=3"), 8)


def test_batch_must_divide_over_batch_axis():
    check_batch(16, 2, "data", {"data": 8})
    with pytest.raises(MeshError, match=r"= 4 sequences per micro-batch do not divide over "
                                        r"mesh axis 'data' \(size 8\)"):
        check_batch(16, 4, "data", {"data": 8})
    shape = {"data": 2, "fsdp": 4}
    check_batch(16, 1, "data", shape, 64, "fsdp")
    with pytest.raises(MeshError, match=r"data.sequence_length \(30\) does not divide over "
                                        r"mesh axis 'fsdp' \(size 4\)"):
        check_batch(16, 1, "data", shape, 30, "fsdp")


def test_the_batch_error_comes_before_the_sharding_error():
    # What Run checks first: the axes the rules would use, before any spec is resolved
    # (resolve_spec would raise its generic ShardingError for the same batch).
    shape = {"data": 8}
    axis = candidate_axis("activation_batch", DEFAULT_RULES, shape)
    assert axis == "data"
    with pytest.raises(MeshError, match="train.global_batch_size"):
        check_batch(12, 1, axis, shape)
    assert candidate_axis("activation_length", DEFAULT_RULES, {"data": 2, "fsdp": 4},
                          used=("data",)) == "fsdp"
    assert candidate_axis("activation_length", DEFAULT_RULES, {"fsdp": 4},
                          used=("fsdp",)) is None


def test_num_clients_from_dtensor_jobs(monkeypatch):
    monkeypatch.setenv("DTENSOR_JOBS", "localhost:1000,localhost:1001")
    assert num_clients() == 2
    monkeypatch.delenv("DTENSOR_JOBS")
    assert num_clients() == 1


class _FakeDTensor:
    """Records what build_mesh asks of DTensor on a host with (faked) GPUs."""

    def __init__(self, already_initialized=None):
        self.calls, self.already = [], already_initialized

    def initialize_accelerator_system(self, kind, **kwargs):
        self.calls.append(("init", kind, os.environ.get(devices.NCCL_ENV)))
        if self.already:
            raise ValueError(self.already)
        return kind

    def create_mesh(self, axes, devices, device_type):
        self.calls.append(("mesh", axes, len(devices), device_type))
        return "mesh"


_GPU_ENV = (devices.NCCL_ENV, "TF_DEVICE_MIN_SYS_MEMORY_IN_MB", "TF_GPU_ALLOCATOR")


@pytest.fixture(autouse=True)
def _restore_gpu_env(monkeypatch):
    """build_mesh sets these in os.environ; monkeypatch undoes only what it recorded, so
    record each (a leaked NCCL setting would reach the multi-client tests' workers)."""
    for name in _GPU_ENV:
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


def _build_on_fake_gpus(monkeypatch, fake, gpus=8):
    import tensorflow.experimental
    monkeypatch.setattr(devices, "_gpu_count", lambda: gpus)
    monkeypatch.setattr(tensorflow.experimental, "dtensor", fake)
    return mesh.build_mesh("data=2,fsdp=4", "GPU")


def test_a_single_process_gpu_mesh_uses_nccl(monkeypatch):
    fake = _FakeDTensor()
    assert _build_on_fake_gpus(monkeypatch, fake) == "mesh"
    # NCCL is asked for before DTensor initializes the GPUs (which reads the variable).
    assert fake.calls == [("init", "GPU", "1"), ("mesh", [("data", 2), ("fsdp", 4)], 8, "GPU")]
    assert os.environ[devices.NCCL_ENV] == "1"


def test_an_explicit_no_to_nccl_is_kept(monkeypatch):
    monkeypatch.setenv(devices.NCCL_ENV, "0")
    fake = _FakeDTensor()
    _build_on_fake_gpus(monkeypatch, fake)
    assert [c[0] for c in fake.calls] == ["mesh"] and os.environ[devices.NCCL_ENV] == "0"


def test_a_worker_launched_with_device_cpu_keeps_nccl_off(monkeypatch):
    # `tfllm launch --device cpu` sets TFLLM_DEVICE=cpu in every worker; a mesh that still
    # lands on GPUs (device_type=GPU in the config) runs without NCCL, as asked.
    from tfllm.launch.device import DEVICE_ENV
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    fake = _FakeDTensor()
    _build_on_fake_gpus(monkeypatch, fake)
    assert [c[0] for c in fake.calls] == ["mesh"] and os.environ[devices.NCCL_ENV] == "0"


def test_nccl_is_taken_back_with_a_warning_when_tensorflow_started_first(monkeypatch):
    fake = _FakeDTensor("TensorFlow has already been initialized. ...")
    with pytest.warns(UserWarning, match="without NCCL"):
        _build_on_fake_gpus(monkeypatch, fake)
    # fsdp._sliced_reduction reads the variable: it must say what DTensor really does.
    assert os.environ[devices.NCCL_ENV] == "0"


def test_cpu_meshes_leave_nccl_alone(monkeypatch):
    mesh.build_mesh("data=2", "CPU")
    assert devices.NCCL_ENV not in os.environ


_SPY = """
import sys
import tfllm.parallel.mesh as m
from tensorflow.python.eager import context

def spy(*args, **kwargs):
    print("initialized before the mesh:", context.context()._initialized, flush=True)
    raise SystemExit(0)

m.build_mesh = spy
from tfllm.cli.main import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_tfllm_train_builds_the_mesh_before_tensorflow_starts(tmp_path):
    # NCCL can only be turned on before TensorFlow initializes (see
    # devices._initialize_gpus_single_client): nothing on `tfllm train`'s path may start it first.
    import subprocess
    import sys
    from tests.harness import ROOT, TF_HANG_S
    run = subprocess.run([sys.executable, "-c", _SPY, "train", "--config", "configs/tiny.yaml",
                          "--workdir", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=TF_HANG_S, env=dict(os.environ, PYTHONPATH=ROOT))
    assert "initialized before the mesh: False" in run.stdout, run.stdout + run.stderr[-2000:]


def test_a_gpu_mesh_sets_the_memory_reserve_before_tensorflow_makes_its_devices(monkeypatch):
    fake = _FakeDTensor()
    import tensorflow.experimental
    monkeypatch.setattr(devices, "_gpu_count", lambda: 8)
    monkeypatch.setattr(tensorflow.experimental, "dtensor", fake)
    mesh.build_mesh("fsdp=8", "GPU", gpu_memory_reserve_mb=6144,
                    gpu_allocator="cuda_malloc_async")
    assert os.environ["TF_DEVICE_MIN_SYS_MEMORY_IN_MB"] == "6144"
    assert os.environ["TF_GPU_ALLOCATOR"] == "cuda_malloc_async"


def test_a_mesh_smaller_than_the_host_uses_and_shows_only_its_gpus(monkeypatch):
    import tensorflow as tf
    shown = []
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: [f"GPU:{i}" for i in range(8)] if kind == "GPU"
                        else [])
    monkeypatch.setattr(tf.config, "set_visible_devices",
                        lambda devices, kind: shown.append((list(devices), kind)))
    fake = _FakeDTensor()
    import tensorflow.experimental
    monkeypatch.setattr(tensorflow.experimental, "dtensor", fake)
    mesh.build_mesh("data=2", "GPU")
    # Hidden before DTensor initializes (TensorFlow claims the memory of every visible GPU).
    assert shown == [(["GPU:0", "GPU:1"], "GPU")]
    assert fake.calls[-1] == ("mesh", [("data", 2)], 2, "GPU")
