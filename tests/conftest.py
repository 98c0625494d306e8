"""Test setup: 8 logical CPU devices, global-state hygiene (fixtures and hooks only).

The helpers tests share (tiny configs, the parity harness, real processes) are in
tests/harness.py.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Reference and sharded runs must differ only by sharding, not by oneDNN's blocked
# kernels choosing different summation orders for different shard shapes.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import pytest  # noqa: E402

from tests.harness import fake_cluster_tools  # noqa: E402
from tfllm.runtime.devices import setup_cpu_devices  # noqa: E402

NUM_DEVICES = 8
assert setup_cpu_devices(NUM_DEVICES) == NUM_DEVICES, "TensorFlow was initialized too early"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="Rewrite tests/golden/*.json from the current layouts.")


# ---- test tiers: `slow` tells the truth (tests/tiers.py: the hooks and why) ------------
from tests.tiers import (  # noqa: E402,F401  (pytest finds hooks by name here)
    pytest_collection_modifyitems, pytest_runtest_makereport, pytest_runtest_protocol,
    pytest_terminal_summary)


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")


@pytest.fixture(scope="session", autouse=True)
def cluster_tools(tmp_path_factory):
    """Slurm's and ssh's commands are fakes, first on PATH, for every test and every
    process a test starts: a real Slurm or sshd installed on this machine is never reached
    by accident (a real `scontrol` answered a launcher test's nodelist). Tests that fake a
    tool themselves put theirs before these. Yields (bin directory, calls file)."""
    bin_dir, calls = fake_cluster_tools(tmp_path_factory.mktemp("cluster-tools"))
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    yield bin_dir, calls


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Dtype policies and Keras global state never leak from one test to the next."""
    yield
    keras.config.set_dtype_policy("float32")


def _restore(saved):
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def _restore_environment_per_module():
    """What a module-scoped fixture sets (a mesh's DTensor lowering variables, which a
    child process inherits: LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2 changed the
    outcome of another module's probe in CI) ends with its module."""
    saved = dict(os.environ)
    yield
    _restore(saved)


@pytest.fixture(autouse=True)
def _restore_environment():
    """A command run in this process (`main([...])`) sets variables for its own process
    (TF_XLA_FLAGS naming its workdir's XLA cache, NCCL and allocator settings). They must
    not reach the next test's child processes: a later `tfllm train` child would load
    programs another test compiled and dump nothing."""
    saved = dict(os.environ)
    yield
    _restore(saved)
