"""Test tiers that tell the truth: pytest hooks that tests/conftest.py takes in.

The quick loop is `pytest -m "not slow"`. A test outside it is marked `slow` because of
what it does (starts a Python process, executes a notebook, compiles a parity mesh
through XLA) or how long it takes. Both are checked on every run: an unmarked test that
starts a Python process, or whose setup and call take longer than the limit, fails with
a line saying to mark it. Every test gets a timeout that fits its tier unless it names
its own (pytest-timeout).

"Takes longer" means both: the wall time is over TFLLM_UNMARKED_LIMIT_S (default 20 s,
for a test with the machine to itself) times pytest-xdist's workers, which share the
cores; and the worker process spent more than TFLLM_UNMARKED_LIMIT_S of CPU time (all
its threads) on it. A test that took long on the clock while its process did not work
(a starved or paused worker on a shared machine: one clean-clone run saw a 0.07 s test
take 59 s) is not failed for it; it is listed at the end of the run, with its CPU and
garbage-collection seconds, so that a cause can be found.
"""

import gc
import os
import subprocess
import sys
import threading
import time

import pytest

TIER_TIMEOUT_S = {"quick": 120, "slow": 900}
_tier = threading.local()  # the item being set up or run, in the main thread
_starts = {}  # nodeid -> argv of the Python processes an unmarked test started
_gc_s = [0.0, None]  # seconds spent in garbage collection so far, start of the current one


def unmarked_limits():
    """(wall seconds, CPU seconds) an unmarked test may take, read from the environment
    before each test's setup (a test of these hooks sets its own for the tests it runs)."""
    cpu = float(os.environ.get("TFLLM_UNMARKED_LIMIT_S", "20"))
    return cpu * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), cpu


def _gc_clock(phase, info):
    if phase == "start":
        _gc_s[1] = time.perf_counter()
    elif _gc_s[1] is not None:
        _gc_s[0] += time.perf_counter() - _gc_s[1]
        _gc_s[1] = None


if _gc_clock not in gc.callbacks:
    gc.callbacks.append(_gc_clock)


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(
                TIER_TIMEOUT_S["slow" if _is_slow(item) else "quick"]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    outer = getattr(_tier, "item", None)  # a pytest run inside a test (this module's tests)
    _tier.item = item
    item._tier_limits = unmarked_limits()
    item._tier_clocks = (time.process_time(), _gc_s[0])
    try:
        yield
    finally:
        _tier.item = outer


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
    cpu0, gc0 = getattr(item, "_tier_clocks", (time.process_time(), _gc_s[0]))
    cpu, in_gc = time.process_time() - cpu0, _gc_s[0] - gc0
    wall_limit, cpu_limit = getattr(item, "_tier_limits", None) or unmarked_limits()
    if took > wall_limit and cpu > cpu_limit:
        problems.append(f"it took {took:.0f} s and {cpu:.0f} CPU s ({in_gc:.1f} s of them "
                        f"in garbage collection) for its setup and call, over the quick "
                        f"tier's {wall_limit:g} s and {cpu_limit:g} CPU s "
                        "(TFLLM_UNMARKED_LIMIT_S, the wall time times the pytest-xdist "
                        "workers)")
    elif took > wall_limit:
        report.user_properties.append(
            ("tier_waited", f"{took:.0f} s with {cpu:.1f} CPU s, {in_gc:.1f} s in "
                            "garbage collection"))
    if problems:
        report.outcome = "failed"
        report.longrepr = ("unmarked test in the quick tier: " + "; ".join(problems)
                           + ". Mark it @pytest.mark.slow (and say why in the testing docs) "
                           "or make it cheaper.")


def pytest_terminal_summary(terminalreporter):
    waited = [(r.nodeid, dict(r.user_properties)["tier_waited"])
              for r in terminalreporter.stats.get("passed", [])
              if "tier_waited" in dict(getattr(r, "user_properties", ()))]
    if waited:
        terminalreporter.section("unmarked tests that took long while their process waited")
        for nodeid, what in waited:
            terminalreporter.write_line(f"{nodeid}: {what}")
