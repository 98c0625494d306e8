"""Exact resume after a real SIGTERM/SIGINT; exit codes; non-finite policies.

Real processes (`python -m tfllm.cli.main train`), real signals, hard timeouts, and
process groups killed in `finally` so that nothing is left behind.
"""

import os
import signal

import pytest

from tests.harness import (TF_HANG_S, finish, kill_group, metrics_records, signal_at_step,
                           start_process, tfllm_command, tfllm_env, write_text_corpus)

TIMEOUT_S = TF_HANG_S  # bounds a hang only
PREEMPTED, NONFINITE = 75, 3


def _args(workdir, *extra):
    # A mesh that splits both the batch and the weights, on 4 devices: a process on
    # data=2,model=4 (8 devices) took 38 CPU seconds for 30 steps, on data=2,model=2 23.
    base = ["--config", "configs/tiny.yaml", "--workdir", str(workdir),
            "--set", "mesh.axes=data=2,model=2", "--set", "model.max_sequence_length=32",
            "--set", "data.sequence_length=16", "--set", "train.log_every=1",
            "--set", "train.deterministic=true", "--set", "checkpoint.every=100",
            "--set", "train.eval_steps=2", "--set", "train.sample_tokens=0",
            "--set", "mesh.num_cpu_devices=4"]
    for e in extra:
        base += ["--set", e]
    return tfllm_command("train", *base)


# lr 1e30 without clipping blows the weights up after the first update: from step 2 on
# the loss and gradient norm are not finite.
_EXPLODE = ("data.source=synthetic", "optimizer.learning_rate=1e30", "optimizer.clip_norm=0",
            "optimizer.warmup_steps=0")


def _start(cmd):
    """cmd in its own process group (kill_group reaps it and anything it started)."""
    return start_process(cmd, tfllm_env(PYTHONUNBUFFERED="1"), merge_stderr=True)


def _run(cmd, timeout=TIMEOUT_S):
    return finish(_start(cmd), timeout)[:2]


def _losses(workdir):
    records = metrics_records(workdir)
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _interrupt(cmd, workdir, after_step, sig):
    """Starts cmd; a watcher process sends `sig` once metrics.jsonl reaches `after_step`
    (harness.signal_at_step: a stall of this process cannot let the run finish first);
    returns rc, out."""
    proc = _start(cmd)
    watcher = signal_at_step(workdir / "metrics.jsonl", after_step, sig, proc.pid)
    try:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        kill_group(watcher)
        kill_group(proc)
    return proc.returncode, out


def _as_parquet(pattern, path, monkeypatch):
    """The documents of the text files `pattern` as rows of a parquet file, read offline
    with `datasets`' cache beside it (the runs inherit the environment)."""
    import glob

    datasets = pytest.importorskip("datasets")
    docs = [doc for name in sorted(glob.glob(pattern))
            for doc in open(name, encoding="utf-8").read().split("<|endoftext|>")]
    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(path))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(path.parent / "hf-cache"))
    return str(path)


@pytest.mark.slow
@pytest.mark.multiprocess
# SIGTERM (what schedulers send) with text data, whose iterator state must resume
# exactly, and with the same documents as a parquet file (data.source=hf: its position
# is a block of rows and the texts still buffered); SIGINT takes the same handler
# (tests/train/test_preemption.py).
@pytest.mark.parametrize("sig, source", [(signal.SIGTERM, "text"), (signal.SIGTERM, "hf")])
def test_signal_saves_exits_75_and_resume_is_exact(tmp_path, sig, source, monkeypatch):
    extra = ["train.steps=30", f"data.source={source}"]
    if source in ("text", "hf"):  # the data-iterator position must be restored too
        pattern = write_text_corpus(tmp_path / "corpus")
        if source == "hf":
            pattern = _as_parquet(pattern, tmp_path / "corpus.parquet", monkeypatch)
        extra += [f"data.paths=[\"{pattern}\"]", "data.tokenizer=byte",
                  "model.vocab_size=260", "data.validation_fraction=0.2",
                  f"data.data_dir={tmp_path / 'cache'}"]
    rc, out = _run(_args(tmp_path / "full", *extra))
    assert rc == 0, out[-3000:]
    full = _losses(tmp_path / "full")

    rc, out = _interrupt(_args(tmp_path / "cut", *extra), tmp_path / "cut", 3, sig)
    assert rc == PREEMPTED, out[-3000:]
    assert "run the same command to resume" in out
    stopped = max(_losses(tmp_path / "cut"))
    assert 3 <= stopped < 30
    # Resume: the same command (no --config needed: the workdir has its config).
    rc, out = _run(tfllm_command("train", "--workdir", str(tmp_path / "cut")))
    assert rc == 0, out[-3000:]
    assert f"resuming after step {stopped}" in out
    resumed = _losses(tmp_path / "cut")
    assert sorted(resumed) == sorted(full)
    # Bitwise: the same program on the same mesh with op determinism on, from bit-exact
    # restored weights, optimizer states and data position.
    for step in range(stopped + 1, 31):
        assert resumed[step] == full[step], (step, resumed[step], full[step])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_nonfinite_abort_keeps_the_last_good_checkpoint(tmp_path):
    cmd = _args(tmp_path / "w", "train.steps=6", *_EXPLODE, "checkpoint.every=1")
    rc, out = _run(cmd)
    assert rc == NONFINITE, out[-3000:]
    assert "is not finite" in out and "step 2" in out
    steps = sorted(p.name for p in (tmp_path / "w" / "checkpoints").iterdir())
    assert steps == ["step_00000001"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_nonfinite_skip_counts_every_skipped_step(tmp_path):
    cmd = _args(tmp_path / "w", "train.steps=5", *_EXPLODE, "train.on_nonfinite=skip")
    rc, out = _run(cmd)
    assert rc == 0, out[-3000:]
    records = metrics_records(tmp_path / "w")
    last = [r for r in records if "skipped_steps" in r][-1]
    assert last["step"] == 5 and last["skipped_steps"] == 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_signal_during_the_first_compilation_saves_after_step_one(tmp_path):
    # SIGTERM as soon as the mesh line is printed: the first step (and its compilation)
    # is still to come; the run finishes it, saves step 1 and exits 75.
    proc = _start(_args(tmp_path / "w", "train.steps=30", "data.source=synthetic"))
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "on mesh [" in line:
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(seen) + proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == PREEMPTED, out[-3000:]
    assert os.listdir(tmp_path / "w" / "checkpoints") == ["step_00000001"]
