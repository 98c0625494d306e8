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
