"""multiworker.sh (the wrapper of `tfllm launch`) argument and environment errors: exit 2
before anything starts (no TF)."""

import re
import shutil
import socket
import subprocess

import pytest

from tfllm.launch.main import FLAG_OPTIONS, VALUED_OPTIONS, reserve_free_ports
from tests.launch.helpers import LAUNCHER, PY, ROOT, launcher_env, run

CMD = ["--", "true"]


def _hostfile(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("args, env, expected", [
    ([*CMD], {}, "--mode is required"),
    (["--mode", "mpi", *CMD], {}, "--mode 'mpi' is unknown"),
    (["--mode", "local", "--num-workers", "0", *CMD], {}, "--num-workers must be at least 1"),
    (["--mode", "local", "--num-workers", "two", *CMD], {}, "--num-workers must be at least 1"),
    (["--mode", "local", *CMD], {}, "--num-workers is required"),
    (["--mode", "local", "--num-workers", "2"], {}, "no command after '--'"),
    (["--mode", "local", "--num-workers", "2", "--"], {}, "no command after '--'"),
    (["--mode", "local", "--num-workers", "2", "--bogus", *CMD], {}, "unknown argument '--bogus'"),
    (["--mode", "local", "--num-workers", "2", "--kill-timeout", "-1", *CMD], {},
     "--kill-timeout must be a whole number"),
    (["--mode", "local", "--num-workers", "2", "--port", "70000", *CMD], {},
     "--port must be a TCP port number"),
    (["--mode", "local", "--num-workers", "2", "--ready-pattern", "a[", *CMD], {},
     "--ready-pattern 'a[' is not a valid regular expression"),
    (["--mode", "local", "--num-workers", "2", "--port"], {}, "--port needs a value"),
    (["--mode", "hostfile", *CMD], {}, "--mode hostfile needs --hostfile"),
    (["--mode", "hostfile", "--hostfile", "/nonexistent/hosts", *CMD], {},
     "--hostfile '/nonexistent/hosts' does not exist"),
    (["--mode", "slurm", *CMD], {}, "SLURM_PROCID is not set"),
    (["--mode", "slurm", *CMD], {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
     "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST"),
    (["--mode", "slurm", *CMD], {"SLURM_PROCID": "0", "SLURM_NTASKS": "3",
                                 "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"},
     "add up to 2, not SLURM_NTASKS=3"),
    (["--mode", "env", "--world-size", "2", "--hosts", "a,b", *CMD], {}, "--mode env: no rank"),
    (["--mode", "env", "--hosts", "a,b", *CMD], {"JOB_COMPLETION_INDEX": "1"},
     "--mode env: no world size"),
    (["--mode", "env", "--rank", "2", "--world-size", "2", "--hosts", "a,b", *CMD], {},
     "--rank must be in 0..1"),
    (["--mode", "env", "--rank", "0", "--world-size", "2", *CMD], {}, "--mode env needs the hosts"),
    (["--mode", "env", "--rank", "0", "--world-size", "4", "--hosts", "a,b,c", *CMD], {},
     "--hosts has 3 entries"),
    (["--mode", "local", "--num-workers", "2", "--device", "tpu", *CMD], {},
     "--device 'tpu' is unknown"),
    # --per-gpu never leaves an inherited CUDA_VISIBLE_DEVICES.
    (["--mode", "local", "--num-workers", "3", "--per-gpu", *CMD],
     {"CUDA_VISIBLE_DEVICES": "3,5"}, "--per-gpu: 3 workers per host but "
     "CUDA_VISIBLE_DEVICES='3,5' lists 2 GPU(s); start at most 2 per host (--num-workers)"),
    (["--mode", "local", "--per-gpu", *CMD], {"CUDA_VISIBLE_DEVICES": ""},
     "--num-workers is required"),  # an empty list hides every GPU: none to count
    (["--mode", "slurm", "--per-gpu", *CMD], {"SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                                              "SLURM_JOB_NODELIST": "n1",
                                              "CUDA_VISIBLE_DEVICES": "0,1"},
     "start at most 2 per host (srun --ntasks-per-node)"),
])
def test_bad_arguments_exit_2_naming_the_option(tmp_path, args, env, expected):
    log_dir = tmp_path / "logs"
    code, out, err = run(["--log-dir", str(log_dir), *args],
                         env=launcher_env(**env))
    assert code == 2, (out, err)
    assert expected in err, err
    assert "--help" in err  # says where to read more
    assert not log_dir.exists()  # failed before anything started


def test_empty_hostfile(tmp_path):
    hosts = _hostfile(tmp_path, "# only a comment\n\n")
    code, _, err = run(["--mode", "hostfile", "--hostfile", hosts, *CMD])
    assert code == 2 and "lists no hosts" in err, err


def test_a_host_that_would_be_an_ssh_option_is_refused(tmp_path):
    marker = tmp_path / "injected"
    hosts = _hostfile(tmp_path, f"nodeA\n-oProxyCommand=touch {marker}\n")
    code, _, err = run(["--mode", "hostfile", "--hostfile", hosts, "--log-dir",
                        str(tmp_path / "logs"), *CMD])
    assert code == 2, err
    assert "'-oProxyCommand=touch" in err and "starts with '-'" in err, err
    assert not marker.exists() and not (tmp_path / "logs").exists()


def test_ssh_gets_the_host_after_double_dash(tmp_path):
    hosts = _hostfile(tmp_path, "nodeA\n")
    code, out, err = run(["--mode", "hostfile", "--hostfile", hosts, "--dry-run", *CMD])
    assert code == 0, err
    assert "exec: ssh -o BatchMode=yes -- nodeA 'sh -c " in out, out


def test_free_ports_stay_reserved_for_the_workers():
    # No bind-release race: a free port stays bound by the launcher (SO_REUSEPORT, not
    # listening) until released; another program cannot take it, a worker whose gRPC
    # server sets SO_REUSEPORT (TF_GRPC_REUSE_PORT=1) can.
    ports = reserve_free_ports(2)
    try:
        assert len(set(ports.numbers)) == 2
        for port in ports.numbers:
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("", port))
            with socket.socket() as worker:
                worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                worker.bind(("", port))
                worker.listen()
    finally:
        ports.release()
    for port in ports.numbers:
        with socket.socket() as later:
            later.bind(("", port))  # released


@pytest.mark.parametrize("port_args, reuse", [([], True), (["--port", "23456"], False)])
def test_workers_share_reserved_ports_only(port_args, reuse):
    code, out, err = run(["--mode", "local", "--num-workers", "2", *port_args, "--dry-run",
                          *CMD])
    assert code == 0, err
    assert out.count("TF_GRPC_REUSE_PORT=1") == (2 if reuse else 0), out


def test_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run(["--mode", "local", "--num-workers", "1", "--port", str(port),
                            "--log-dir", str(tmp_path / "logs"), *CMD])
    assert code == 2, err
    assert f"port {port} is in use" in err and "--port" in err, err
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_help_documents_every_option():
    code, out, _ = run(["--help"])
    assert code == 0
    parsed = set(VALUED_OPTIONS) | set(FLAG_OPTIONS)  # what the parser accepts
    assert len(parsed) > 15
    for option in sorted(parsed):
        assert re.search(rf"^\s+(-h, )?{option}\b", out, re.M), f"{option} is not in --help"
    for code_doc in ("0 ", "2 ", "124", "75", "128+N"):
        assert code_doc in out
    # `tfllm launch` is the same launcher under its own name.
    r = subprocess.run([PY, "-m", "tfllm.cli.main", "launch", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env=launcher_env())
    assert r.returncode == 0 and r.stdout.startswith("Usage: tfllm launch --mode MODE")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_clean():
    result = subprocess.run(["shellcheck", LAUNCHER], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
