"""Test setup: 8 logical CPU devices, global-state hygiene (fixtures and hooks only).

The helpers tests share (tiny configs, the parity harness, real processes) are in
tests/harness.py.
"""

import os
import subprocess
import sys
import threading

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


# ---- test tiers: `slow` tells the truth ---------------------------------------------------
# The quick loop is `pytest -m "not slow"`. A test outside it is marked `slow` because of
# what it does (starts a Python process, executes a notebook, compiles a parity mesh
# through XLA) or how long it takes. Both are checked here, on every run: an unmarked test
# that starts a Python process, or takes longer than UNMARKED_LIMIT_S (setup and call
# together), fails with a line saying to mark it. Every test gets a timeout that fits its
# tier unless it names its own (pytest-timeout).
# The limit is for a test with the machine to itself: under pytest-xdist's N workers
# (README: -n 2 on 2 cores) each has a share of the CPU, so it is N times longer.
UNMARKED_LIMIT_S = (float(os.environ.get("TFLLM_UNMARKED_LIMIT_S", "20"))
                    * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
TIER_TIMEOUT_S = {"quick": 120, "slow": 900}
_tier = threading.local()  # the item being set up or run, in the main thread
_starts = {}  # nodeid -> argv of the Python processes an unmarked test started


def _is_slow(item):
    return item.get_closest_marker("slow") is not None


def _starts_python(args):
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    words = os.fsdecode(argv[0]).split()
    first = words[0] if words else ""
    return os.path.basename(first).startswith("python") or first == sys.executable


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kwargs):
    item = getattr(_tier, "item", None)
    if item is not None and not _is_slow(item) and _starts_python(args):
        _starts.setdefault(item.nodeid, []).append(args)
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(
                TIER_TIMEOUT_S["slow" if _is_slow(item) else "quick"]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _tier.item = item
    try:
        yield
    finally:
        _tier.item = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item._tier_setup_s = report.duration
    if report.when != "call" or _is_slow(item) or not report.passed:
        return
    problems = []
    started = _starts.pop(item.nodeid, None)
    if started:
        problems.append(f"it starts {len(started)} Python process(es), e.g. "
                        f"{' '.join(map(str, started[0]))[:160]}")
    took = getattr(item, "_tier_setup_s", 0.0) + report.duration
    if took > UNMARKED_LIMIT_S:
        problems.append(f"it took {took:.0f} s (setup and call), over the quick tier's "
                        f"{UNMARKED_LIMIT_S:.0f} s (TFLLM_UNMARKED_LIMIT_S times the "
                        "pytest-xdist workers)")
    if problems:
        report.outcome = "failed"
        report.longrepr = ("unmarked test in the quick tier: " + "; ".join(problems)
                           + ". Mark it @pytest.mark.slow (and say why in the testing docs) "
                           "or make it cheaper.")


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
