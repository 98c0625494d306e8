"""SIGTERM and SIGINT are one graceful stop (the end-to-end resume test sends SIGTERM)."""

import os
import signal

import pytest

from tfllm.train.preemption import SignalWatcher


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_either_signal_requests_a_stop_and_the_previous_handler_returns(sig):
    before = signal.getsignal(sig)
    with SignalWatcher() as watcher:
        assert not watcher.requested
        os.kill(os.getpid(), sig)
        assert watcher.requested and watcher.signame == signal.Signals(sig).name
    assert signal.getsignal(sig) is before


# A watcher, then a long call into C that releases the GIL and never looks at signals
# (as SentencePiece's training or tf.data's corpus build do): Python runs a handler only
# once that call returns, which took minutes here; the second signal must not wait.
_BUSY = """
import hashlib, sys, time
from tfllm.train.preemption import SignalWatcher
with SignalWatcher():
    print("ready", flush=True)
    if sys.argv[1] == "c":
        hashlib.pbkdf2_hmac("sha256", b"p", b"s", 10 ** 9)  # minutes of C, no signal checks
    else:  # in Python: its handler and the counting thread both see the second signal
        for _ in range(60000):
            time.sleep(0.01)
    print("returned", flush=True)
"""


@pytest.mark.slow  # a process of its own
@pytest.mark.multiprocess
@pytest.mark.parametrize("busy", ["c", "python"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once_while_the_main_thread_is_in_c(sig, busy):
    from tests.harness import PY, finish, start_process, wait_delivered
    from tfllm.contracts import HARD_STOP_EXIT_CODE
    proc = start_process([PY, "-c", _BUSY, busy])
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(2):  # apart: two pending signals would merge into one
            proc.send_signal(sig)
            wait_delivered(proc, sig)
        # 300 s bounds a hang only (the C call alone runs for minutes; stopped, milliseconds)
        code, out, err = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == HARD_STOP_EXIT_CODE, err
    assert "returned" not in out
    assert err.count(f"stopped at once by a second signal ({sig.name})") == 1, err


def test_a_watcher_leaves_the_wakeup_descriptor_as_it_found_it():
    # (asyncio, a notebook's kernel, keeps its own there)
    import socket
    a, b = socket.socketpair()
    a.setblocking(False)
    previous = signal.set_wakeup_fd(a.fileno())
    try:
        with SignalWatcher():
            with SignalWatcher():  # nested (the command's and train()'s): one counter
                pass
    finally:
        assert signal.set_wakeup_fd(previous) == a.fileno()
        a.close()
        b.close()
