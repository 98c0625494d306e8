"""The tier hooks (tests/tiers.py) on tests of their own, run by pytest in this process.

The cases say how long they took: the hooks read clocks that the cases advance (the
run's config stash holds them), so these tests pass on any machine at any load.
"""

import os
import re
import sys

import pytest

from tests.tiers import TIER_TIMEOUT_S, over_limits, starts_python


class FakeClocks:
    """(wall, CPU, garbage-collection) seconds that move only when a test moves them."""

    def __init__(self):
        self.now = [0.0, 0.0, 0.0]

    def __call__(self):
        return tuple(self.now)

    def advance(self, wall=0.0, cpu=0.0, gc=0.0):
        self.now = [self.now[0] + wall, self.now[1] + cpu, self.now[2] + gc]


CONFTEST = '''
import pytest
from tests.tiers import (CLOCKS_KEY, pytest_collection_modifyitems, pytest_runtest_makereport,
    pytest_runtest_protocol, pytest_terminal_summary)
from tests.test_tiers import FakeClocks

def pytest_configure(config):
    config.stash[CLOCKS_KEY] = FakeClocks()

@pytest.fixture
def clocks(request):
    return request.config.stash[CLOCKS_KEY]
'''

CASES = '''
import subprocess
import sys
import pytest

def test_works(clocks):
    clocks.advance(wall=31.0, cpu=25.0, gc=0.5)

@pytest.mark.slow
def test_works_but_marked(clocks):
    clocks.advance(wall=31.0, cpu=25.0)

def test_waits(clocks):
    clocks.advance(wall=59.0, cpu=0.2, gc=57.8)

def test_threads(clocks):
    clocks.advance(wall=12.0, cpu=24.0)

def test_quick(clocks):
    clocks.advance(wall=29.9, cpu=9.9)  # just under both

@pytest.fixture
def slow_setup(clocks):
    clocks.advance(wall=20.0, cpu=20.0)

def test_setup_counts(slow_setup, clocks):
    clocks.advance(wall=10.5, cpu=0.5)

def test_starts_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.timeout(7)
def test_timeouts(request):
    assert request.node.get_closest_marker("timeout").args[0] == 7

@pytest.mark.slow
def test_slow_timeout(request):
    assert request.node.get_closest_marker("timeout").args[0] == %(slow)d

def test_quick_timeout(request):
    assert request.node.get_closest_marker("timeout").args[0] == %(quick)d
''' % TIER_TIMEOUT_S


@pytest.fixture
def run_cases(pytester, monkeypatch):
    monkeypatch.setenv("TFLLM_UNMARKED_LIMIT_S", "10")  # wall limit 30 s with 3 workers
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.delenv("TFLLM_TIER_STRICT", raising=False)
    monkeypatch.syspath_prepend(str(pytester.path))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_cases=CASES)
    return lambda: pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist",
                                                "-W", "ignore::DeprecationWarning")


def _report(result):
    out = result.stdout.str()
    assert "unmarked tests over the quick tier's limits" in out, out
    section = out.split("unmarked tests over the quick tier's limits")[1]
    return section.split("\n=")[0].strip().splitlines()[1:]  # up to the next section


def test_time_is_reported_not_failed_and_starting_python_always_fails(run_cases):
    result = run_cases()
    result.assert_outcomes(passed=9, failed=1)
    result.stdout.fnmatch_lines([
        "*unmarked test in the quick tier: it starts 1 Python process(es), e.g. *"
        "Mark it @pytest.mark.slow*",
        "FAILED test_cases.py::test_starts_python - *",
    ])
    assert _report(result) == [
        "test_cases.py::test_waits: 59.0 s, 0.2 CPU s, 57.8 s in garbage collection; its "
        "process waited (a busy or paused machine, or a stall in the test)",
        "test_cases.py::test_works: 31.0 s, 25.0 CPU s, 0.5 s in garbage collection; its "
        "process worked past both limits: mark it slow or make it cheaper",
        "test_cases.py::test_setup_counts: 30.5 s, 20.5 CPU s, 0.0 s in garbage collection; "
        "its process worked past both limits: mark it slow or make it cheaper",
        "test_cases.py::test_threads: 12.0 s, 24.0 CPU s, 0.0 s in garbage collection; its "
        "threads used more CPU than the limit in less wall time",
        "(limits: 30 s of wall time and 10 CPU s. Reported, not failed: time depends on the "
        "machine; TFLLM_TIER_STRICT=1 on an idle machine fails the tests that worked past "
        "both. docs/testing.md, 'Reading the tier report')",
    ]


def test_a_maintainer_can_fail_the_tests_that_worked_past_the_limits(run_cases, monkeypatch):
    monkeypatch.setenv("TFLLM_TIER_STRICT", "1")
    result = run_cases()
    result.assert_outcomes(passed=7, failed=3)
    result.stdout.fnmatch_lines([
        "*unmarked test in the quick tier: it took 31 s and 25 CPU s (0.5 s of them in "
        "garbage collection) for its setup and call, over the quick tier's 30 s and 10 CPU s "
        "(TFLLM_TIER_STRICT is set). Mark it @pytest.mark.slow*",
    ])
    failed = re.findall(r"FAILED test_cases.py::(\w+)", result.stdout.str())
    assert sorted(failed) == ["test_setup_counts", "test_starts_python", "test_works"]
    assert len(_report(result)) == 5  # still listed, the waiting ones too


@pytest.mark.parametrize("took, cpu, kind", [
    (31, 11, "worked"), (31, 9, "waited"), (29, 11, "busy"), (29, 9, None), (30, 10, None)])
def test_a_test_is_over_a_limit_only_past_it(took, cpu, kind):
    assert over_limits(took, cpu, (30, 10)) == kind


def test_the_tier_timeouts_bound_hangs_with_room_for_a_busy_machine():
    # docs/testing.md, "A busy machine": the slowest test of each tier measured with two
    # CPU-bound processes beside `pytest -n 2` on 2 cores, 2026-11-28 (AMD EPYC): quick,
    # a stall of 145.5 s (138 s inside garbage collection) in the loaded full suite; slow,
    # test_a_sharded_mesh_is_planned_per_device, 245.9 s.
    slowest_loaded_s = {"quick": 145.5, "slow": 245.9}
    for tier, seconds in slowest_loaded_s.items():
        assert TIER_TIMEOUT_S[tier] >= 5 * seconds, tier


@pytest.mark.parametrize("argv, python", [
    ([sys.executable, "-c", "pass"], True),
    ("python3 -m tfllm train", True),
    (["/usr/bin/python3.11", "x.py"], True),
    (["bash", "-c", "python3 x.py"], False),
    (["sbatch", "job.sh"], False),
    ([], False),
])
def test_a_python_process_is_told_apart_from_other_commands(argv, python):
    assert starts_python(argv) == python


def test_every_heavy_test_is_named_as_it_exists():
    """tests/heavy.txt names tests by node id: each one's module holds its function (a
    renamed test would otherwise silently run in CI again, or never)."""
    from tests.tiers import heavy_ids
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ids = heavy_ids()
    assert len(ids) > 0
    for node in ids:
        path, name = node.split("::")[0], re.sub(r"\[.*$", "", node.split("::")[-1])
        with open(os.path.join(root, path)) as f:
            assert f"def {name}(" in f.read(), node
