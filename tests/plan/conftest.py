"""One run of each tiny step per session: the plan tests share their tiny DTensor steps.

`tfllm.plan.measured.run_tiny` runs the tiny step of a mesh in a child process, an XLA
compile of every device's clusters per layer count (1-2 minutes on 2 cores). Several tests
run the same step: `plan()` measures it by default (tests/plan/test_plan.py), and
tests/plan/test_measured.py reads the collectives and buffers of the same mesh. A step is a
function of its config, mesh and layer count, so each runs once per session
(tests/harness.py's `session_dir`, shared by pytest-xdist's workers, behind a file lock:
a worker that needs a step another is running waits for it).
"""

import contextlib
import fcntl
import json

import pytest

from tfllm.config import to_dict
from tfllm.plan import measured
from tests.harness import LONG_TF_HANG_S, session_dir, session_key


@pytest.fixture(scope="session")
def tiny_step_dir(tmp_path_factory):
    return session_dir(tmp_path_factory, "tiny_steps")


@pytest.fixture(autouse=True)
def _tiny_steps_run_once(monkeypatch, tiny_step_dir):
    run_tiny = measured.run_tiny

    def once(config, shape, layers=(1, 2), timeout=LONG_TF_HANG_S, jit_compile=True, tiny=True,
             dump_to=None):
        if dump_to:  # the HLO dump is what the caller reads: run it
            return run_tiny(config, shape, layers, timeout=timeout, jit_compile=jit_compile,
                            tiny=tiny, dump_to=dump_to)
        # the tiny width too: a test may run the same config at two widths
        paths = {n: tiny_step_dir / (session_key([to_dict(config), sorted(shape.items()), n,
                                                  jit_compile, tiny,
                                                  measured.tiny_width(dict(shape))]) + ".json")
                 for n in sorted(layers)}
        with contextlib.ExitStack() as stack:
            for path in paths.values():  # in layer order: two workers never deadlock
                lock = stack.enter_context(open(path.with_suffix(".lock"), "w"))
                fcntl.flock(lock, fcntl.LOCK_EX)
            missing = tuple(n for n, path in paths.items() if not path.exists())
            if missing:  # one child runs them all, as run_tiny does
                ran = run_tiny(config, shape, missing, timeout=timeout,
                               jit_compile=jit_compile, tiny=tiny)
                for n in missing:
                    paths[n].write_text(json.dumps(ran[n]))
            return {n: json.loads(path.read_text()) for n, path in paths.items()}

    monkeypatch.setattr(measured, "run_tiny", once)
