"""The tier hooks (tests/tiers.py) on tests of their own, run by pytest in this process."""

import re
import sys

import pytest

from tests.tiers import starts_python

HOOKS = ("from tests.tiers import (pytest_collection_modifyitems, pytest_runtest_makereport,\n"
         "    pytest_runtest_protocol, pytest_terminal_summary)\n")

CASES = '''
import time
import pytest

def _busy(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_busy():
    _busy(0.6)

@pytest.mark.slow
def test_busy_but_marked():
    _busy(0.6)

def test_waits():
    time.sleep(0.6)

def test_quick():
    pass

@pytest.mark.timeout(7)
def test_timeouts(request):
    named = request.node.get_closest_marker("timeout").args[0]
    assert named == 7

@pytest.mark.slow
def test_slow_timeout(request):
    assert request.node.get_closest_marker("timeout").args[0] == 900

def test_quick_timeout(request):
    assert request.node.get_closest_marker("timeout").args[0] == 120
'''


@pytest.fixture
def run_cases(pytester, monkeypatch):
    monkeypatch.setenv("TFLLM_UNMARKED_LIMIT_S", "0.3")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.syspath_prepend(str(pytester.path))
    pytester.makeconftest(HOOKS)
    pytester.makepyfile(test_cases=CASES)
    return lambda: pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist",
                                                "-W", "ignore::DeprecationWarning")


def test_an_unmarked_test_that_works_past_the_limit_fails_and_one_that_waits_is_listed(
        run_cases):
    result = run_cases()
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines([
        "unmarked test in the quick tier: it took 1 s and 1 CPU s (* s of them in garbage "
        "collection) for its setup and call, over the quick tier's 0.3 s and 0.3 CPU s *"
        "Mark it @pytest.mark.slow*",
        "FAILED test_cases.py::test_busy - *",
    ])
    out = result.stdout.str()
    section = out.split("unmarked tests that took long while their process waited")[1]
    listed = section.split("\n=")[0].strip().splitlines()[1:]  # up to the next section
    assert len(listed) == 1 and re.fullmatch(
        r"test_cases.py::test_waits: 1 s with 0\.\d CPU s, 0\.\d s in garbage collection",
        listed[0]), listed


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
