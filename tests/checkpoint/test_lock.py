"""One writer per run (tfllm.checkpoint.lock): a second `tfllm train` on a live run is
refused naming the live process, before it writes or clears anything; the lock goes with
its process however it ends, and a lock file left by a dead process is taken over."""

import json
import os
import signal
import time

import pytest

from tfllm.checkpoint.lock import RunLock
from tfllm.checkpoint.workdir import WorkdirError
from tfllm.cli.main import main
from tests.harness import (TF_HANG_S, finish, snapshot_tree, start_process, tfllm_command,
                           tiny_overrides)


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    first = RunLock(str(tmp_path), 0).acquire()
    with pytest.raises(WorkdirError, match=rf"a tfllm train \(pid {os.getpid()} on .*\) is "
                                           "writing this run; wait for it to end"):
        RunLock(str(tmp_path), 0).acquire()
    with RunLock(str(tmp_path), 1):  # another client of the same run: its own lock
        pass
    first.release()
    with RunLock(str(tmp_path), 0) as again:  # released: free again
        assert again.previous is None  # this very process held it


def test_a_dead_holder_s_lock_is_taken_over_and_named(tmp_path):
    lock_dir = tmp_path / ".tfllm-locks"
    lock_dir.mkdir()
    dead = {"pid": 999999, "host": "elsewhere", "started": "2026-01-01T00:00:00"}
    (lock_dir / "client_0.holder").write_text(json.dumps(dead))
    with RunLock(str(tmp_path), 0) as lock:
        assert lock.previous == dead
        assert json.loads((lock_dir / "client_0.holder").read_text())["pid"] == os.getpid()
    # let go: the record goes, the (empty) lock file stays
    assert sorted(os.listdir(lock_dir)) == ["client_0.lock"]


def test_a_lock_folder_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".tfllm-locks")
    with pytest.raises(WorkdirError, match="is not a folder tfllm made"):
        RunLock(str(tmp_path), 0).acquire()
    assert os.listdir(tmp_path / "elsewhere") == []


@pytest.mark.slow  # a training process and a second train in this one: ~30 s
def test_a_second_train_on_a_live_run_is_refused_and_the_first_finishes(tmp_path, capsys):
    run = str(tmp_path / "run")
    # no save while the test looks (pruning would remove files by itself)
    sets = [a for o in tiny_overrides("gpt", **{"train.steps": 100000,
                                                "checkpoint.every": 100000,
                                                "train.log_every": 1})
            for a in ("--set", o)]
    proc = start_process(tfllm_command("train", "--workdir", run, *sets))
    try:
        lock_file = os.path.join(run, ".tfllm-locks", "client_0.lock")
        deadline = time.monotonic() + TF_HANG_S  # bounds a hang only
        while time.monotonic() < deadline and not os.path.exists(os.path.join(run,
                                                                              "metrics.jsonl")):
            time.sleep(0.5)  # training: past set-up, its files written
        assert os.path.exists(lock_file), "the first run never took its lock"
        before = snapshot_tree(run)
        capsys.readouterr()
        assert main(["train", "--workdir", run, *sets]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {proc.pid}" in err[0] and "is writing this run" in err[0]
        # nothing of the live run was cleared or rewritten by the refused one
        after = snapshot_tree(run)
        assert set(before) <= set(after) | {n for n in before if "tmp" in n}
        proc.send_signal(signal.SIGTERM)
        code, out, _ = finish(proc, timeout=TF_HANG_S)
        assert code == 75, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    # it let go as it ended: its record is gone, the lock free for the run's next train
    assert os.listdir(os.path.join(run, ".tfllm-locks")) == ["client_0.lock"]
    with RunLock(run, 0) as lock:
        assert lock.previous is None


def test_a_checkpoint_folder_reached_by_a_link_is_held_by_its_writer(tmp_path):
    # A second workdir whose checkpoints/ links to a live run's deleted that run's
    # in-flight save, resumed from it and pruned the same folder: the lock covers the
    # real checkpoint folder, however it is reached.
    first, second, disk = tmp_path / "first", tmp_path / "second", tmp_path / "disk"
    (disk / "ckpt").mkdir(parents=True)
    first.mkdir()
    second.mkdir()
    os.symlink(disk / "ckpt", first / "checkpoints")
    (disk / "ckpt" / "step_00000001.tmp-0a0b").mkdir()  # a live save under way
    with RunLock(str(first), 0):
        record = json.loads((disk / "ckpt" / ".tfllm-writer").read_text())
        assert record["pid"] == os.getpid() and record["workdir"] == str(first)
        for link in (disk / "ckpt", first / "checkpoints", disk / ".." / "disk" / "ckpt"):
            (second / "checkpoints").unlink(missing_ok=True)
            os.symlink(link, second / "checkpoints")
            with pytest.raises(WorkdirError, match=(
                    rf"--workdir {second}: the checkpoint folder {disk / 'ckpt'} \(its "
                    rf"checkpoints/ leads to .*\) is written by a tfllm train \(pid "
                    rf"{os.getpid()} on .*--workdir {first}\); two runs never share one")):
                RunLock(str(second), 0).acquire()
            # refused as a whole: its own workdir lock is let go too
            assert not (second / ".tfllm-locks" / "client_0.holder").exists()
        with RunLock(str(second), 1):  # other clients take no checkpoint-folder lock
            pass
    assert sorted(os.listdir(disk / "ckpt")) == ["step_00000001.tmp-0a0b"]  # record gone
    with RunLock(str(second), 0):  # free once the first let go
        pass


def test_a_new_run_holds_its_checkpoint_folder_when_it_makes_it(tmp_path):
    lock = RunLock(str(tmp_path / "run"), 0).acquire()
    try:
        assert not (tmp_path / "run" / "checkpoints").exists()  # not made before the marker
        lock.hold_checkpoints()
        assert (tmp_path / "run" / "checkpoints" / ".tfllm-writer").is_file()
        with pytest.raises(WorkdirError, match="is written by a tfllm train"):
            other = tmp_path / "other"
            other.mkdir()
            os.symlink(tmp_path / "run" / "checkpoints", other / "checkpoints")
            RunLock(str(other), 0).acquire()
    finally:
        lock.release()
    assert os.listdir(tmp_path / "run" / "checkpoints") == []


def test_a_checkpoints_link_to_nothing_is_one_line(tmp_path):
    os.symlink(tmp_path / "missing", tmp_path / "checkpoints")
    with pytest.raises(WorkdirError, match="is not a folder .*a link to nothing"):
        RunLock(str(tmp_path), 0).acquire()


@pytest.mark.slow  # a training process and a second train in this one
@pytest.mark.multiprocess
def test_a_second_workdir_linked_to_a_live_run_s_checkpoints_is_refused(tmp_path, capsys):
    # the audit's case: it deleted the live run's in-flight save, resumed from it and
    # pruned the same folder
    live, second = str(tmp_path / "live"), tmp_path / "second"
    sets = [a for o in tiny_overrides("gpt", **{"train.steps": 100000,
                                                "checkpoint.every": 1,
                                                "train.log_every": 1})
            for a in ("--set", o)]
    proc = start_process(tfllm_command("train", "--workdir", live, *sets))
    try:
        checkpoints = os.path.join(live, "checkpoints")
        deadline = time.monotonic() + TF_HANG_S  # bounds a hang only
        while time.monotonic() < deadline and not any(
                os.path.exists(os.path.join(checkpoints, n, "COMMIT"))
                for n in (os.listdir(checkpoints) if os.path.isdir(checkpoints) else [])):
            time.sleep(0.5)  # a committed checkpoint: the second workdir holds "a run"
        second.mkdir()
        os.symlink(checkpoints, second / "checkpoints")
        capsys.readouterr()
        assert main(["train", "--workdir", str(second), *sets]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {proc.pid}" in err[0], err
        assert f"--workdir {os.path.abspath(live)}" in err[0]
        assert "two runs never share one" in err[0]
        proc.send_signal(signal.SIGTERM)
        code, out, _ = finish(proc, timeout=TF_HANG_S)
        assert code == 75, out[-2000:]  # the live run saved and stopped as usual
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(os.listdir(second)) == [".tfllm-locks", "checkpoints"]  # wrote nothing
    assert not os.path.exists(os.path.join(checkpoints, ".tfllm-writer"))  # let go
