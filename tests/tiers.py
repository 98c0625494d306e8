"""Test tiers that tell the truth: pytest hooks that tests/conftest.py takes in.

The quick loop is `pytest -m "not slow"`. A test outside it is marked `slow` because of
what it does (starts a Python process, executes a notebook, compiles a parity mesh
through XLA) or how long it takes. What a test does is a fact about the test, and is
checked on every run: an unmarked test that starts a Python process fails with a line
saying to mark it. How long it takes is a fact about the test *and the machine*: time is
reported, never asserted. At the end of a run, every unmarked test whose setup and call
went past the quick tier's limits is listed with its wall, CPU and garbage-collection
seconds; the run does not fail for it unless a maintainer asks, on an idle machine, with
TFLLM_TIER_STRICT=1 (docs/testing.md, "Reading the tier report").

The limits: wall time over TFLLM_UNMARKED_LIMIT_S (default 20 s, for a test with the
machine to itself) times pytest-xdist's workers, which share the cores; CPU time (all the
worker's threads) over TFLLM_UNMARKED_LIMIT_S. A test over both worked past the limit:
mark it slow or make it cheaper. A test over the wall limit only took long while its
process did not work (a starved or paused worker on a shared machine: one clean-clone run
saw a 0.07 s test take 59 s, 58 s of it in garbage collection).

Every test also gets a timeout for its tier (pytest-timeout) unless it names its own.
These bound hangs, not speed: each is at least 5 times the slowest test of its tier
measured on a 2-core machine with two CPU-bound processes beside the suite
(docs/testing.md, "A busy machine").
"""

import gc
import os
import subprocess
import sys
import threading
import time

import pytest

# Hang bounds (s). Slowest measured with two CPU-bound processes beside `pytest -n 2` on
# 2 cores (docs/testing.md, "A busy machine"): see the page for the figures.
TIER_TIMEOUT_S = {"quick": 900, "slow": 1800}
STRICT_VARIABLE = "TFLLM_TIER_STRICT"
_tier = threading.local()  # the item being set up or run, in the main thread
_starts = {}  # nodeid -> argv of the Python processes an unmarked test started
_gc_s = [0.0, None]  # seconds spent in garbage collection so far, start of the current one


def _gc_clock(phase, info):
    if phase == "start":
        _gc_s[1] = time.perf_counter()
    elif _gc_s[1] is not None:
        _gc_s[0] += time.perf_counter() - _gc_s[1]
        _gc_s[1] = None


if _gc_clock not in gc.callbacks:
    gc.callbacks.append(_gc_clock)


def process_clocks():
    """(wall, CPU, garbage-collection) seconds so far, for this process."""
    return time.perf_counter(), time.process_time(), _gc_s[0]


# The clocks a run reads: this process's, unless a run's config puts others in its stash
# (tests/test_tiers.py runs these hooks with clocks it advances itself).
CLOCKS_KEY = pytest.StashKey()


def _clocks(config):
    return config.stash.get(CLOCKS_KEY, process_clocks)


def unmarked_limits():
    """(wall seconds, CPU seconds) an unmarked test may take, read from the environment
    before each test's setup (a test of these hooks sets its own for the tests it runs)."""
    cpu = float(os.environ.get("TFLLM_UNMARKED_LIMIT_S", "20"))
    return cpu * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), cpu


def strict() -> bool:
    """Whether tests over the limits fail the run (a maintainer's idle machine only)."""
    return os.environ.get(STRICT_VARIABLE, "") not in ("", "0")


def _is_slow(item):
    return item.get_closest_marker("slow") is not None


def starts_python(args):
    """Whether a Popen argv starts a Python interpreter."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    words = os.fsdecode(argv[0]).split()
    first = words[0] if words else ""
    return os.path.basename(first).startswith("python") or first == sys.executable


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kwargs):
    item = getattr(_tier, "item", None)
    if item is not None and not _is_slow(item) and starts_python(args):
        _starts.setdefault(item.nodeid, []).append(args)
    _popen_init(self, args, *rest, **kwargs)


if getattr(subprocess.Popen.__init__, "__name__", "") != "_guarded_popen_init":
    subprocess.Popen.__init__ = _guarded_popen_init


from tests.harness import IN_CHILD  # noqa: E402  (run_in_child's marker variable)

HEAVY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heavy.txt")
HEAVY_ENV = "TFLLM_HEAVY"


def heavy_ids(path=HEAVY_FILE) -> set:
    """The node ids tests/heavy.txt lists (lines "SECONDS  NODE_ID"; # comments)."""
    with open(path) as f:
        return {line.split()[1] for line in f if line.strip() and not line.startswith("#")}


def runs_heavy(config) -> bool:
    """Whether this run keeps the `heavy` tests: asked for (TFLLM_HEAVY=1, or any -m or
    -k expression, which then decides), named by node id on the command line, or a child
    pytest that runs one test (harness.run_in_child)."""
    return (os.environ.get(HEAVY_ENV) == "1" or bool(config.option.markexpr)
            or bool(config.option.keyword) or any("::" in str(a) for a in config.args)
            or bool(os.environ.get(IN_CHILD)))


def pytest_collection_modifyitems(config, items):
    heavy = heavy_ids()
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(
                TIER_TIMEOUT_S["slow" if _is_slow(item) else "quick"]))
        if item.nodeid in heavy:
            item.add_marker(pytest.mark.heavy)
    if not runs_heavy(config):
        left_out = [i for i in items if i.nodeid in heavy]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [i for i in items if i.nodeid not in heavy]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    outer = getattr(_tier, "item", None)  # a pytest run inside a test (this module's tests)
    _tier.item = item
    item._tier_limits = unmarked_limits()
    item._tier_start = _clocks(item.config)()
    try:
        yield
    finally:
        _tier.item = outer


def over_limits(took, cpu, limits):
    """'worked' (over the wall and the CPU limit), 'waited' (over the wall limit only,
    with its process idle), 'busy' (over the CPU limit only: threads worked in parallel)
    or None, for a test's wall and CPU seconds against (wall limit, CPU limit)."""
    wall_limit, cpu_limit = limits
    if took > wall_limit and cpu > cpu_limit:
        return "worked"
    if took > wall_limit:
        return "waited"
    if cpu > cpu_limit:
        return "busy"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or _is_slow(item) or not report.passed:
        return
    started = _starts.pop(item.nodeid, None)
    if started:  # what the test does, whatever the machine: always a failure
        report.outcome = "failed"
        report.longrepr = (f"unmarked test in the quick tier: it starts {len(started)} "
                           f"Python process(es), e.g. {' '.join(map(str, started[0]))[:160]}. "
                           "Mark it @pytest.mark.slow (and say why in the testing docs).")
        return
    now = _clocks(item.config)()
    start = getattr(item, "_tier_start", now)
    took, cpu, in_gc = (b - a for a, b in zip(start, now))
    limits = getattr(item, "_tier_limits", None) or unmarked_limits()
    kind = over_limits(took, cpu, limits)
    if kind is None:
        return
    report.user_properties.append(("tier_report", (kind, took, cpu, in_gc, *limits)))
    if kind == "worked" and strict():
        report.outcome = "failed"
        report.longrepr = (f"unmarked test in the quick tier: it took {took:.0f} s and "
                           f"{cpu:.0f} CPU s ({in_gc:.1f} s of them in garbage collection) "
                           f"for its setup and call, over the quick tier's {limits[0]:g} s "
                           f"and {limits[1]:g} CPU s ({STRICT_VARIABLE} is set). Mark it "
                           "@pytest.mark.slow (and say why in the testing docs) or make it "
                           "cheaper.")


_MEANING = {
    "worked": "its process worked past both limits: mark it slow or make it cheaper",
    "waited": "its process waited (a busy or paused machine, or a stall in the test)",
    "busy": "its threads used more CPU than the limit in less wall time",
}


def report_lines(reports) -> tuple:
    """(lines, limits): the end-of-run lines for the tests (pytest reports) over the
    limits, slowest first, and the (wall, CPU) limits they were held to (workers set
    them: the wall limit counts pytest-xdist's workers)."""
    rows, limits = [], None
    for r in reports:
        props = dict(getattr(r, "user_properties", ()))
        if "tier_report" in props:
            kind, took, cpu, in_gc, *limits = props["tier_report"]
            rows.append((took, f"{r.nodeid}: {took:.1f} s, {cpu:.1f} CPU s, {in_gc:.1f} s "
                               f"in garbage collection; {_MEANING[kind]}"))
    return [line for _, line in sorted(rows, key=lambda row: -row[0])], limits


def pytest_terminal_summary(terminalreporter):
    stats = terminalreporter.stats
    lines, limits = report_lines(r for key in ("passed", "failed") for r in stats.get(key, ()))
    if not lines:
        return
    wall_limit, cpu_limit = limits
    terminalreporter.section("unmarked tests over the quick tier's limits")
    for line in lines:
        terminalreporter.write_line(line)
    terminalreporter.write_line(
        f"(limits: {wall_limit:g} s of wall time and {cpu_limit:g} CPU s. Reported, not "
        f"failed: time depends on the machine; {STRICT_VARIABLE}=1 on an idle machine fails "
        "the tests that worked past both. docs/testing.md, 'Reading the tier report')")
