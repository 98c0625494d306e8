"""The doctor's node checks as pure functions, on fake directory trees and on NCCL log text
written in the format NCCL prints: where XLA finds libdevice and ptxas, why client 0
cannot reach a port, which transport NCCL picked and when to warn about it, and the
job findings built from them (tfllm.doctor.xla_files, ports, nccl_log, findings)."""

import errno
import os
import socket

import pytest

from tfllm.doctor import allreduce, job as doctor, nccl_log, xla_files
from tfllm.launch import ports


# ---- libdevice and ptxas, where XLA looks ----------------------------------------------------
def _cuda(root, ptxas=False):
    """A fake CUDA root with libdevice (and bin/ptxas)."""
    os.makedirs(os.path.join(root, "nvvm", "libdevice"))
    open(os.path.join(root, xla_files.LIBDEVICE), "w").close()
    if ptxas:
        os.makedirs(os.path.join(root, "bin"))
        open(os.path.join(root, "bin", "ptxas"), "w").close()
    return str(root)


@pytest.fixture
def site(tmp_path):
    """A fake site-packages with a tensorflow package and no CUDA anywhere."""
    (tmp_path / "env" / "lib" / "python3.11" / "site-packages" / "tensorflow").mkdir(
        parents=True)
    return tmp_path / "env" / "lib" / "python3.11" / "site-packages"


def _search(environ, site, tmp_path, others=()):
    return xla_files.libdevice(environ, str(site / "tensorflow"),
                               system_roots=[str(tmp_path / "usr-local-cuda")],
                               other_patterns=others)


def test_libdevice_of_the_nvcc_wheel_beside_tensorflow(site, tmp_path):
    wheel = _cuda(site / "nvidia" / "cuda_nvcc", ptxas=True)
    found = _search({}, site, tmp_path)
    assert found["found"] == os.path.join(wheel, xla_files.LIBDEVICE)
    assert xla_files.libdevice_finding(found, gpu=True) == (
        "ok", f"XLA's libdevice: {found['found']}")
    assert xla_files.ptxas({"PATH": ""}, str(site / "tensorflow"), ()) == \
        os.path.join(wheel, "bin", "ptxas")


def test_xla_flags_directory_comes_first_and_a_wrong_one_is_a_warning(site, tmp_path):
    flagged = _cuda(tmp_path / "my-cuda")
    _cuda(tmp_path / "usr-local-cuda")
    env = {"XLA_FLAGS": f"--xla_gpu_autotune_level=0 --xla_gpu_cuda_data_dir={flagged}"}
    assert _search(env, site, tmp_path)["found"] == os.path.join(flagged, xla_files.LIBDEVICE)
    env = {"XLA_FLAGS": f"--xla_gpu_cuda_data_dir={tmp_path / 'nothing'}"}
    found = _search(env, site, tmp_path)
    assert found["found"].startswith(str(tmp_path / "usr-local-cuda"))
    level, message = xla_files.libdevice_finding(found, gpu=True)
    assert level == "warning" and "XLA falls back to" in message


def test_no_libdevice_on_a_gpu_node_is_an_error_naming_the_fix(site, tmp_path):
    found = _search({}, site, tmp_path)
    level, message = xla_files.libdevice_finding(found, gpu=True)
    assert level == "error"
    assert "pip install 'tensorflow[and-cuda]'" in message
    assert "XLA_FLAGS=--xla_gpu_cuda_data_dir=DIR" in message
    assert str(site / "nvidia" / "cuda_nvcc") in message  # where it looked


def test_a_toolkit_xla_does_not_look_in_is_named_in_the_fix(site, tmp_path):
    versioned = _cuda(tmp_path / "cuda-12.4")
    found = _search({}, site, tmp_path, others=[str(tmp_path / "cuda-*")])
    assert found["found"] is None and found["elsewhere"] == versioned
    level, message = xla_files.libdevice_finding(found, gpu=True)
    assert level == "error" and f"XLA_FLAGS=--xla_gpu_cuda_data_dir={versioned}" in message
    cuda_dir = _cuda(tmp_path / "opt-cuda-dir")
    assert _search({"CUDA_DIR": cuda_dir}, site, tmp_path)["elsewhere"] == cuda_dir


def test_a_cpu_node_gets_a_note_not_an_error(site, tmp_path):
    level, message = xla_files.libdevice_finding(_search({}, site, tmp_path), gpu=False)
    assert (level, message) == ("ok", "no GPU: XLA's libdevice is not needed here")


# ---- ports: bound as gRPC binds them, reached from client 0 ------------------------------
def test_listeners_answer_with_their_greeting_and_close(tmp_path):
    with ports.Listeners([0], b"tfllm-doctor rank 1 abc\n") as heard:
        (port,) = heard.listening
        assert not ports.port_free(port)  # held while the doctor runs
        assert ports.probe("127.0.0.1", port, b"tfllm-doctor rank 1 abc\n") is None
        what, why = ports.probe("127.0.0.1", port, b"tfllm-doctor rank 2 xyz\n")
        assert what == "another program answered" and "another machine" in why
    assert ports.port_free(port)  # closed: the job's runtime binds it next


def test_a_port_nobody_listens_on_is_refused_with_its_likely_cause():
    with socket.socket() as s:  # a free port, closed again
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    what, why = ports.probe("127.0.0.1", port, b"x\n", timeout_s=2)
    assert what == "connection refused" and "firewall" in why


def test_a_silent_program_on_the_port_is_not_the_doctor():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        what, _ = ports.probe("127.0.0.1", server.getsockname()[1], b"x\n", timeout_s=0.5)
    assert what == "another program answered"


def test_a_port_held_without_reuse_cannot_be_listened_on():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        port = held.getsockname()[1]
        assert not ports.port_free(port)
        with ports.Listeners([port], b"x\n") as heard:
            assert heard.bound == {port: None} and heard.listening == []


def test_a_port_the_launcher_holds_with_reuseport_is_free_to_its_worker():
    with socket.socket() as held:  # tfllm launch's reservation (main.Ports)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("0.0.0.0", 0))
        port = held.getsockname()[1]
        assert ports.port_free(port, reuse=ports.reuse_port({"TF_GRPC_REUSE_PORT": "1"}))
        with ports.Listeners([port], b"x\n", reuse=True) as heard:
            assert heard.listening == [port]


@pytest.mark.parametrize("error, what, cause", [
    (socket.gaierror(-2, "Name or service not known"), "does not resolve", "/etc/hosts"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "refused", "firewall"),
    (socket.timeout("timed out"), "no answer within 5 s", "NCCL_SOCKET_IFNAME"),
    (OSError(errno.EHOSTUNREACH, "No route to host"), "no route", "NCCL_SOCKET_IFNAME"),
    (OSError(errno.ENETUNREACH, "Network is unreachable"), "no route", "wrong interface"),
])
def test_each_connection_failure_names_its_likely_cause(error, what, cause):
    found_what, found_cause = ports.cause(error)
    assert what in found_what and cause in found_cause


# ---- NCCL's log: the transport it picked --------------------------------------------------
# Written in the format NCCL 2.21 prints with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
# (host:pid:tid [cuda device] NCCL INFO ...); two nodes of 2 GPUs, rank 0's process.
TWO_NODES_IB = """\
gpu-a:2104:2104 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.11<0>
gpu-a:2104:2104 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
gpu-a:2104:2188 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.1.0.11<0>
gpu-a:2104:2188 [0] NCCL INFO Using network IB
gpu-a:2104:2188 [0] NCCL INFO comm 0x5581c0 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 18000 commId 0x9c1e - Init START
gpu-a:2104:2188 [0] NCCL INFO Channel 00/02 :    0   1   2   3
gpu-a:2104:2188 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu-a:2104:2188 [0] NCCL INFO Channel 01/0 : 3[1] -> 0[0] [receive] via NET/IB/1/GDRDMA
gpu-a:2104:2188 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:2104:2188 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:2104:2189 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
gpu-a:2104:2189 [1] NCCL INFO Channel 01/0 : 1[1] -> 2[0] [send] via NET/IB/1/GDRDMA
gpu-a:2104:2188 [0] NCCL INFO Connected all rings
gpu-a:2104:2188 [0] NCCL INFO comm 0x5581c0 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 18000 commId 0x9c1e - Init COMPLETE
"""
# The same job where NCCL fell back: TCP between the nodes, host memory within them
# (older NCCL: bus ids in the brackets, no connection index).
TWO_NODES_FALLBACK = """\
gpu-a:2104:2188 [0] NCCL INFO NET/IB : No device found.
gpu-a:2104:2188 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.11<0>
gpu-a:2104:2188 [0] NCCL INFO Using network Socket
gpu-a:2104:2188 [0] NCCL INFO Channel 00 : 3[1c000] -> 0[1b000] [receive] via NET/Socket/0
gpu-a:2104:2188 [0] NCCL INFO Channel 00 : 0[1b000] -> 1[1c000] via SHM/direct/direct
gpu-a:2104:2189 [1] NCCL INFO Channel 00 : 1[1c000] -> 2[1b000] [send] via NET/Socket/0
"""
TOPO_NVLINK = """\
\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tPXB\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tPXB\t0-55,112-167\t0\t\tN/A
NIC0\tPXB\tPXB\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
"""
TOPO_PCIE = TOPO_NVLINK.replace("NV18", "PIX")


def test_transports_are_read_from_nccls_channel_lines():
    assert nccl_log.transports(TWO_NODES_IB) == {"NET/IB": 4, "P2P/CUMEM": 2}
    assert nccl_log.network(TWO_NODES_IB) == "IB"
    assert nccl_log.transports(TWO_NODES_FALLBACK) == {"NET/Socket": 2, "SHM": 1}
    assert nccl_log.network(TWO_NODES_FALLBACK) == "Socket"
    assert nccl_log.transports("no NCCL here\n") == {}


@pytest.mark.parametrize("via, transport", [
    ("P2P/IPC/read", "P2P/IPC"), ("P2P/direct pointer", "P2P/direct pointer"),
    ("P2P/CUMEM", "P2P/CUMEM"), ("SHM/CE/direct", "SHM"), ("NET/IBext_v8/0/GDRDMA",
                                                              "NET/IBext_v8"),
    ("NET/AWS Libfabric/3/GDRDMA/Shared", "NET/AWS Libfabric"), ("NET/Socket/1", "NET/Socket"),
])
def test_each_transport_name(via, transport):
    assert nccl_log.transport_of(via) == transport


def test_nvlink_is_read_from_the_gpu_rows_of_nvidia_smi_topo():
    assert nccl_log.nvlink_in_topology(TOPO_NVLINK)
    assert not nccl_log.nvlink_in_topology(TOPO_PCIE)  # the legend's "NV#" is no link
    assert not nccl_log.nvlink_in_topology("")


def test_host_links_read_nvidia_smi_and_the_infiniband_class(tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    ran = lambda cmd, **kw: type("Done", (), {"stdout": TOPO_NVLINK})()
    assert nccl_log.host_links(ran, str(tmp_path)) == {"nvlink": True, "ib": ["mlx5_0"]}
    assert nccl_log.host_links(ran, str(tmp_path / "none"))["ib"] == []


def test_fallback_transports_warn_where_faster_hardware_exists():
    fallback = nccl_log.transports(TWO_NODES_FALLBACK)
    warnings = nccl_log.transport_warnings(fallback, nvlink=True, ib=["mlx5_0"], nodes=2,
                                           environ={"NCCL_IB_DISABLE": "1"})
    assert len(warnings) == 2
    assert "through host memory (SHM, 1 connections) though NVLink" in warnings[0]
    assert "docker --ipc=host" in warnings[0]
    assert "TCP sockets (2 connections) though this node has InfiniBand devices " \
           "(mlx5_0): NCCL_IB_DISABLE=1" in warnings[1]
    # the same fallback on PCIe nodes without InfiniBand is what the hardware allows
    assert nccl_log.transport_warnings(fallback, nvlink=False, ib=[], nodes=2,
                                       environ={}) == []
    # the fast transports never warn
    assert nccl_log.transport_warnings(nccl_log.transports(TWO_NODES_IB), nvlink=True,
                                       ib=["mlx5_0"], nodes=2, environ={}) == []


def test_sockets_within_one_node_warn():
    warnings = nccl_log.transport_warnings({"NET/Socket": 8}, nvlink=True, ib=[], nodes=1,
                                           environ={"NCCL_P2P_DISABLE": "1",
                                                    "NCCL_SHM_DISABLE": "1"})
    assert warnings == ["NCCL uses TCP sockets (8 connections) between GPUs of one node "
                        "though NVLink connects them: NCCL_P2P_DISABLE=1; NCCL_SHM_DISABLE=1"]


# ---- the bandwidth test's plan and findings ------------------------------------------------
def _report(rank, gpus=8, listening=(9991,)):
    return {"host": f"gpu-{rank}", "rank": rank, "address": f"gpu-{rank}", "tf_gpus": gpus,
            "gpus": ["NVIDIA H100 80GB HBM3 (sm_90)"] * gpus, "listening": list(listening),
            "nccl_env": {}, "links": {"nvlink": True, "ib": ["mlx5_0"]}}


def _probed(reports, failing=()):
    return [{"rank": r, "host": rep["host"], "address": rep["address"], "port": port,
             "error": ["connection refused", "a firewall"] if r in failing else None}
            for r, rep in reports.items() for port in rep["listening"]]


def test_the_bandwidth_test_runs_only_when_every_node_has_gpus_and_answered():
    gpus = {0: _report(0), 1: _report(1)}
    assert doctor.bandwidth_plan(gpus, 2, _probed(gpus)) == {"jobs": "gpu-0:9991,gpu-1:9991"}
    cpus = {0: _report(0, gpus=0), 1: _report(1, gpus=0)}
    assert doctor.bandwidth_plan(cpus, 2, _probed(cpus)) == {
        "skipped": "no GPU: bandwidth test skipped"}
    mixed = {0: _report(0), 1: _report(1, gpus=0)}
    assert "TensorFlow uses no GPU on gpu-1 (rank 1)" in doctor.bandwidth_plan(
        mixed, 2, _probed(mixed))["skipped"]
    assert "ranks are missing" in doctor.bandwidth_plan(gpus, 3, _probed(gpus))["skipped"]
    assert "cannot reach rank 1" in doctor.bandwidth_plan(
        gpus, 2, _probed(gpus, failing=[1]))["skipped"]


def _result(rank, log, devices=16):
    sizes = [8 << 20, 256 << 20]
    seconds = {8 << 20: 2e-4, 256 << 20: 2e-3}
    results = [{"bytes": s, "seconds": seconds[s], "algbw_gbs": s / seconds[s] / 1e9,
                "busbw_gbs": allreduce.bus_bandwidth(s / seconds[s] / 1e9, devices)}
               for s in sizes]
    return {"device_type": "GPU", "devices": devices, "client": rank, "results": results,
            "transports": nccl_log.transports(log), "network": nccl_log.network(log)}


def test_bandwidth_findings_name_the_rates_the_transports_and_the_fallbacks():
    reports = {0: _report(0), 1: _report(1)}
    found = doctor.compare(
        {r: dict(rep, tensorflow="2.21.0", cuda="12.5.1", cudnn="9", nccl="2.21.5",
                 driver="560.35.03", ports={"9991": True}, ptxas="/bin/ptxas", findings=[])
         for r, rep in reports.items()}, 2, 60, _probed(reports), {"jobs": "..."},
        {0: _result(0, TWO_NODES_IB), 1: _result(1, TWO_NODES_FALLBACK)})
    text = "\n".join(f"{f.level}: {f.message}" for f in found)
    # 8 MiB in 0.2 ms: 41.9 GB/s; bus = x 2*15/16
    assert ("ok: all-reduce over 16 GPUs (nccl-tests' convention: bus = algorithm x "
            "2(n-1)/n): 8 MiB 41.9 GB/s algorithm, 78.6 GB/s bus; 256 MiB 134.2 GB/s "
            "algorithm, 251.7 GB/s bus") in text
    assert "ok: NCCL transports: NET/IB x 4, P2P/CUMEM x 2 (network IB) on gpu-0 (rank 0)" \
        in text
    assert "warning: gpu-1 (rank 1): NCCL uses TCP sockets (2 connections) though this " \
           "node has InfiniBand devices (mlx5_0)" in text
    assert "warning: gpu-1 (rank 1): NCCL connects GPUs of this node through host memory" \
        in text
    assert "ok: client 0 reached 2 of 2 job ports of 2 ranks" in text


def test_a_failed_or_missing_all_reduce_is_an_error():
    reports = {0: _report(0), 1: _report(1)}
    for r in reports.values():
        r.update(ports={}, ptxas="/bin/ptxas", findings=[], tensorflow="2.21.0", cuda="12",
                 cudnn="9", nccl="2.21.5", driver="560")
    found = doctor.compare(reports, 2, 60, _probed(reports), {"jobs": "..."},
                           {0: {"error": "the all-reduce did not finish within 900 s"}})
    errors = [f.message for f in found if f.level == "error"]
    assert errors == ["gpu-0 (rank 0): the all-reduce did not finish within 900 s",
                      "gpu-1 (rank 1) wrote no all-reduce result: its test hung or crashed "
                      "(its output says why)"]


def test_bus_bandwidth_is_nccl_tests_convention():
    assert allreduce.bus_bandwidth(100.0, 8) == 175.0
    assert allreduce.bus_bandwidth(100.0, 2) == 100.0
    assert allreduce.bus_bandwidth(100.0, 1) == 0.0


# ---- the job's identity: ranks, addresses, ports as the launcher gives them ------------------
def test_under_the_launcher_the_doctor_uses_its_rank_address_and_port():
    env = {"DTENSOR_JOBS": "gpu-a:9991,gpu-b:9992", "DTENSOR_CLIENT_ID": "1",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert doctor.rank_and_size(env) == (1, 2)
    assert doctor.job_address(env, 1) == "gpu-b"
    assert doctor.node_ports(env, 1, None) == [9992]
    assert doctor.node_ports(env, 1, "9991,9993") == [9991, 9993]
    with pytest.raises(ValueError, match="0-65535"):
        doctor.node_ports(env, 1, "70000")


def test_under_srun_the_address_is_the_slurm_node():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[07-08]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NTASKS_PER_NODE": "1"}
    assert doctor.rank_and_size(env) == (1, 2)
    assert doctor.job_address(env, 1) == "node08"
    assert doctor.node_ports(env, 1, None) == [9991]
    assert doctor.job_address({}, 0) == socket.gethostname()
