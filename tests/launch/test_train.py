"""multiworker.sh --mode local runs real tfllm clients: same losses as one client (TF, slow)."""

import json
import subprocess

import numpy as np
import pytest

from tests.harness import TF_HANG_S
from tests.launch.helpers import (PY, ROOT, assert_no_leftovers, kill_workers, launcher_env,
                                  run)

TIMEOUT_S = TF_HANG_S  # bounds a hang only (and --startup-timeout, which must not fire)


def _train_cmd(workdir, axes, *extra):
    return [PY, "-m", "tfllm.cli.main", "train", "--config", "configs/tiny.yaml",
            "--workdir", str(workdir), "--set", f"mesh.axes={axes}", "--set", "train.steps=3",
            "--set", "train.log_every=1", "--set", "data.source=synthetic", *extra]


def _losses(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return np.array([r["loss"] for r in records if "loss" in r])


@pytest.mark.multiprocess
@pytest.mark.slow
# data=2,fsdp=4: each client loads its data rows and splits their sequence over fsdp
# (two clients on data=2,model=4 are covered by tests/checkpoint and tests/pretrained).
@pytest.mark.parametrize("axes", ["data=2,fsdp=4"])
def test_two_workers_match_one_client(tmp_path, axes):
    single = tmp_path / "single"
    result = subprocess.run(_train_cmd(single, axes), cwd=ROOT, env=launcher_env(),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]

    multi = tmp_path / "multi"
    try:
        code, out, err = run(["--mode", "local", "--num-workers", "2", "--kill-timeout", "5",
                              "--startup-timeout", str(TIMEOUT_S), "--",
                              *_train_cmd(multi, axes, "--set", "mesh.num_cpu_devices=4")],
                             timeout=TIMEOUT_S)
        assert code == 0, (out[-3000:], err[-3000:])
    finally:
        kill_workers(multi / "logs")
    assert_no_leftovers(tmp_path)
    assert f"[rank 0] tfllm: gpt on mesh [{axes.replace(',', ', ')}]" in out
    assert "workers ready" in err
    # Both clients share the workdir: client 0 writes metrics.jsonl, client 1 its own log.
    assert "mesh [" in (multi / "logs" / "client_1.log").read_text()
    assert (multi / "logs" / "rank_0.log").exists() and (multi / "logs" / "rank_1.log").exists()
    # Same mesh and shards, only split across two processes: the collectives run over gRPC
    # instead of in-process and may sum partial results in another order, so float32
    # rounding (not an algorithmic change) is all that may differ.
    np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-5)
