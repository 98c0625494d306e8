"""Running launch/multiworker.sh from tests: hard timeouts, process-group cleanup."""

import os
import shutil
import signal
import socket
import subprocess
import time

# The process helpers every real-process test shares (tests/harness.py), for the launch
# tests' imports too.
from tests.harness import PY, ROOT, finish, kill_group, start_process  # noqa: F401

LAUNCHER = os.path.join(ROOT, "launch", "multiworker.sh")
#: bounds a hang of a launcher run whose workers do not import TensorFlow (a bare
#: `python -c`, a fake ssh): ~0.1 s of Python start-up each, plus the launcher's own waits
#: (--kill-timeout, --startup-timeout: at most 60 s in these tests). It never decides a
#: passing run's outcome (issue 47).
LAUNCHER_HANG_S = 120


def launcher_env(**extra):
    """The test environment minus cluster variables that would change the launcher's mode."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "DTENSOR_", "MULTIWORKER_"))
           and k not in ("JOB_COMPLETION_INDEX", "CUDA_VISIBLE_DEVICES")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", SCONTROL="/nonexistent/scontrol")
    env.update(extra)
    return env


def start(args, env=None, cwd=ROOT):
    """Starts the launcher in its own process group (so a test can kill all it started)."""
    return start_process(["bash", LAUNCHER, *args], env or launcher_env(), cwd)


def run(args, timeout=LAUNCHER_HANG_S, env=None, cwd=ROOT):
    """Runs the launcher to completion: (exit code, stdout, stderr)."""
    return finish(start(args, env, cwd), timeout)


def go_when_ready(go):
    """Python lines (for a `-c` worker) that wait until the file `go` exists: a worker
    that instead exited after a sleep raced the launcher's poll for readiness (a starved
    launcher saw it gone before it saw it ready)."""
    return (f"\nwhile not __import__('os').path.exists({str(go)!r}): "
            "__import__('time').sleep(0.05)\n")


def run_until_ready(args, go, timeout=LAUNCHER_HANG_S, env=None, cwd=ROOT):
    """Runs the launcher; once it says "workers ready after", creates the file `go` (its
    workers wait for it: `go_when_ready`); (exit code, stdout, stderr). A launcher that
    ends or is not ready within `timeout` gets `go` too, so its workers end."""
    folder = os.path.dirname(str(go))
    out_path, err_path = (os.path.join(folder, f"launcher.{n}") for n in ("out", "err"))
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", LAUNCHER, *args], cwd=cwd, env=env or launcher_env(),
                                stdout=out, stderr=err, start_new_session=True)

    def read(path):
        with open(path) as f:
            return f.read()
    try:
        deadline = time.monotonic() + timeout
        while (proc.poll() is None and time.monotonic() < deadline
               and "workers ready after" not in read(err_path)):
            time.sleep(0.1)
        open(str(go), "w").close()
        proc.wait(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, read(out_path), read(err_path)


def leftovers(marker):
    """Processes whose command line contains `marker` (a test's unique tmp path)."""
    out = subprocess.run(["pgrep", "-af", str(marker)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def assert_no_leftovers(marker, wait_s=60.0):
    """Workers are reaped asynchronously by init once orphaned: allow a moment (`wait_s`
    bounds a hang only: it returns as soon as none is left)."""
    deadline = time.monotonic() + wait_s
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(marker), leftovers(marker)


def wait_for_step(proc, workdir, step, timeout_s):
    """Waits until `workdir`'s metrics.jsonl has logged `step` while `proc` (a job that
    trains there) runs. Fails the test, with the job's output, when the job ends first;
    or when `timeout_s` passes (the caller's cleanup then stops the job)."""
    deadline = time.monotonic() + timeout_s
    metrics = os.path.join(str(workdir), "metrics.jsonl")
    marker = f'"step": {step},'
    while True:
        try:
            with open(metrics, encoding="utf-8") as f:
                if marker in f.read():
                    return
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the job ended with {proc.returncode} before step {step}: "
                                 f"{proc.communicate()}")
        assert time.monotonic() < deadline, f"no step {step} in {metrics} after {timeout_s} s"
        time.sleep(0.1)


def kill_workers(log_dir):
    """Last-resort cleanup for a failed test: SIGKILL the worker groups the launcher recorded."""
    path = os.path.join(str(log_dir), "pids")
    if not os.path.exists(path):
        return
    for line in open(path).read().splitlines():
        try:
            os.killpg(int(line.split()[1]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError, IndexError):
            pass


FAKE_NVIDIA_SMI = """#!/bin/sh
# A stand-in for nvidia-smi: records who asked (a remote worker has its DTENSOR_CLIENT_ID
# exported before its host's setup runs; the launcher has none), lists {gpus} GPUs
# (FAKE_GPUS, when a test's host sets it, instead).
echo "${{DTENSOR_CLIENT_ID-launcher}}" >> "$(dirname "$0")/nvidia-smi.calls"
[ "$1" = "-L" ] || exit 1
[ "${{FAKE_GPUS:-{gpus}}}" -gt 0 ] || {{ echo "No devices were found"; exit 6; }}
i=0
while [ "$i" -lt "${{FAKE_GPUS:-{gpus}}}" ]; do
  echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-fake-$i)"
  echo "  MIG 1g.10gb     Device  0: (UUID: MIG-fake-$i)"
  i=$((i + 1))
done
"""


def fake_gpu_host(directory, gpus=None):
    """A bin directory for PATH with `nvidia-smi` listing `gpus` GPUs (None: no nvidia-smi)
    and the few tools the launcher's host-side shell uses, so that the real host's
    nvidia-smi (on a GPU machine) cannot leak in. Returns (bin dir, calls file)."""
    bin_dir = os.path.join(str(directory), f"bin-{gpus}")
    os.makedirs(bin_dir, exist_ok=True)
    for tool in ("grep", "uname", "dirname", "sh"):
        link = os.path.join(bin_dir, tool)
        if not os.path.exists(link):
            os.symlink(shutil.which(tool), link)
    if gpus is not None:
        path = os.path.join(bin_dir, "nvidia-smi")
        with open(path, "w") as f:
            f.write(FAKE_NVIDIA_SMI.format(gpus=gpus))
        os.chmod(path, 0o755)
    return bin_dir, os.path.join(bin_dir, "nvidia-smi.calls")


#: the real Slurm's and sshd's runs (test_real_slurm, test_real_ssh): steps and settings;
#: deterministic, so a resumed run repeats the losses
STEPS = 24
TRAIN = ("--set", f"train.steps={STEPS}", "--set", "train.log_every=1",
         "--set", "data.source=synthetic", "--set", "train.deterministic=true",
         "--set", "train.eval_steps=1", "--set", "checkpoint.every=1000")


def free_port_pair():
    """A port P with P+1 also free (--port-per-rank: rank r listens on P+r)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def reference_losses(tmp_path_factory):
    """One process, the mesh of the real-cluster jobs on two CPU devices (`TRAIN`): the
    losses every run of those jobs must give. Run once per session (tests/harness.py's
    `once_per_session`): test_real_slurm.py and test_real_ssh.py compare with the same."""
    import numpy as np

    from tests.harness import TF_HANG_S, metrics_records, once_per_session, tfllm_command
    command = ("train", "--config", "configs/tiny.yaml", "--set", "mesh.axes=data=2",
               "--set", "mesh.num_cpu_devices=2", *TRAIN)

    def run(folder):
        workdir = folder / "run"
        result = subprocess.run(tfllm_command(*command, "--workdir", str(workdir)),
                                cwd=ROOT, env=launcher_env(), capture_output=True,
                                text=True, timeout=TF_HANG_S)
        assert result.returncode == 0, result.stderr[-3000:]
        return [r["loss"] for r in metrics_records(workdir) if "loss" in r]

    return np.array(once_per_session(tmp_path_factory, ["launch reference", command], run))
