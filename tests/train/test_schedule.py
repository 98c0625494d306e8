"""The step schedule as a pure function: what happens at step n of a run, no TensorFlow."""

import ast
import inspect

from tfllm.train import schedule
from tfllm.train.schedule import Schedule


def _steps_where(plan: Schedule, what: str) -> list:
    return [n for n in range(1, plan.steps + 1) if getattr(plan.at(n), what)]


def test_logs_the_first_every_nth_and_the_last_step():
    plan = Schedule(steps=12, log_every=5)
    assert _steps_where(plan, "log") == [1, 5, 10, 12]
    assert _steps_where(plan, "last") == [12]
    # Without an evaluation, a save or the spike guard, only logged steps read metrics.
    assert _steps_where(plan, "read") == [1, 5, 10, 12]


def test_evaluates_and_saves_every_nth_step_but_never_at_the_last():
    # The last step's save and evaluation follow the loop (the final checkpoint first).
    plan = Schedule(steps=10, log_every=100, eval_every=5, save_every=4)
    assert _steps_where(plan, "evaluate") == [5]
    assert _steps_where(plan, "save") == [4, 8]
    assert _steps_where(plan, "read") == [1, 4, 5, 8, 10]
    never = Schedule(steps=10, log_every=100)  # eval_every=0: no validation data
    assert _steps_where(never, "evaluate") == _steps_where(never, "save") == []


def test_the_spike_guard_reads_every_step():
    plan = Schedule(steps=6, log_every=3, spike_guard=True)
    assert _steps_where(plan, "read") == [1, 2, 3, 4, 5, 6]
    assert _steps_where(plan, "log") == [1, 3, 6]


def test_a_trace_starts_before_its_first_step_and_ends_after_its_last():
    plan = Schedule(steps=8, log_every=10, profile=(3, 5))
    assert _steps_where(plan, "trace_starts") == [3]
    assert _steps_where(plan, "trace_ends") == [5]
    one = Schedule(steps=8, log_every=10, profile=(4, 4))
    assert _steps_where(one, "trace_starts") == _steps_where(one, "trace_ends") == [4]
    assert _steps_where(Schedule(steps=8, log_every=10), "trace_starts") == []


def test_the_schedule_imports_nothing_but_the_standard_library():
    tree = ast.parse(inspect.getsource(schedule))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "dataclasses", "typing"}, imported
