"""The lost-peer watchdog as a unit: heartbeats in a directory, no processes, no TF."""

import io
import json
import time

from tfllm.runtime.watchdog import PeerWatchdog, heartbeat_path, lost_message, peer_from_error
from tfllm.contracts import PEER_LOST_EXIT_CODE


def _beat(workdir, client, beat, done=False):
    path = heartbeat_path(str(workdir), client)
    with open(path, "w") as f:
        json.dump({"client": client, "beat": beat, "step": 7, "done": done}, f)


def test_a_silent_peer_is_lost_a_beating_or_finished_one_is_not(tmp_path):
    (tmp_path / "logs").mkdir()
    for peer in (1, 2):
        _beat(tmp_path, peer, 0)
    w = PeerWatchdog(str(tmp_path), 0, 3, timeout_s=10.0)
    w._seen = {1: (None, 0.0), 2: (None, 0.0)}
    assert w.lost_peer(1.0) is None  # first sight of both heartbeats: they count as change
    _beat(tmp_path, 1, 1)
    assert w.lost_peer(9.0) is None
    # Peer 2 has been silent 12 s (as this client's clock sees it); peer 1 beat at 9 s.
    assert w.lost_peer(13.0) == (2, 12.0)
    _beat(tmp_path, 2, 5, done=True)  # it finished normally: silence is not a loss
    assert w.lost_peer(40.0) == (1, 31.0)  # but peer 1 went silent after 9 s


def test_the_report_is_one_line_with_peer_step_checkpoint_and_code(tmp_path):
    exits, out = [], io.StringIO()
    w = PeerWatchdog(str(tmp_path), 0, 2, timeout_s=0.5, latest_checkpoint=lambda: 20,
                     exit=exits.append, out=out)
    w.step = 23  # before the thread starts: a report 0.5 s after start must see it
    w.start()
    deadline = time.monotonic() + 60  # bounds a hang only: it fires after ~0.7 s
    while not exits and time.monotonic() < deadline:  # peer 1 never writes a heartbeat
        time.sleep(0.05)
    assert exits == [PEER_LOST_EXIT_CODE]
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("tfllm train: error: client 1 stopped responding")
    assert "client 0 was at step 23" in lines[0]
    assert "the latest committed checkpoint is step 20" in lines[0]
    mine = json.loads(open(heartbeat_path(str(tmp_path), 0)).read())
    assert mine["client"] == 0 and not mine["done"]
    w.stop()
    assert json.loads(open(heartbeat_path(str(tmp_path), 0)).read())["done"]


ABORTED = ("{{function_node __inference__train_step_11980}} Collective ops is aborted by: "
           "recvmsg:Connection reset by peer\nAdditional GRPC error information from remote "
           "target /job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf")


def test_collective_errors_name_the_peer():
    assert peer_from_error(ABORTED, own=0) == 1
    assert peer_from_error(ABORTED.replace("task:1", "task:0"), own=0) == -1  # only itself
    assert peer_from_error("Incompatible shapes: [2,3] vs. [3,2]", own=0) is None
    line = lost_message(1, 0, 41, 40, "its connection failed in a collective")
    assert line == ("client 1 stopped responding (its connection failed in a collective) "
                    "while client 0 was at step 41; the latest committed checkpoint is step "
                    "40. Exiting with code 76: restart the job to resume.")


def test_reads_grow_with_the_client_count_and_client_0_hands_on_its_verdict(tmp_path):
    (tmp_path / "logs").mkdir()
    # Client 0 reads the 63 others; every other client reads client 0 alone: 126 reads per
    # interval for 64 clients instead of 64 * 63.
    assert PeerWatchdog(str(tmp_path), 0, 64, 10.0).watched() == list(range(1, 64))
    assert PeerWatchdog(str(tmp_path), 5, 64, 10.0).watched() == [0]
    # A stale verdict from an earlier attempt (there when client 3 starts) is ignored ...
    with open(heartbeat_path(str(tmp_path), 0), "w") as f:
        json.dump({"client": 0, "beat": 9, "done": False, "lost": {"peer": 1, "silent_s": 30}}, f)
    w = PeerWatchdog(str(tmp_path), 3, 4, timeout_s=10.0)
    w._seen = {0: (open(heartbeat_path(str(tmp_path), 0)).read(), 0.0)}
    assert w.lost_peer(1.0) is None
    # ... a new one is taken at once: every client names the peer client 0 found.
    exits, out = [], io.StringIO()
    zero = PeerWatchdog(str(tmp_path), 0, 4, timeout_s=10.0, exit=exits.append, out=out)
    zero._verdict = (2, 12.5)
    zero._write(done=False)
    assert w.lost_peer(2.0) == (2, 12.5)
