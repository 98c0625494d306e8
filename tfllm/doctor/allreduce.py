"""A short all-reduce over every device of a multi-client job, timed: the doctor's
bandwidth test (`tfllm doctor --report-dir` runs it on GPU nodes, `tfllm.doctor.job`).

`python -m tfllm.doctor.allreduce --device GPU` runs once per client with DTensor's
multi-client environment (`DTENSOR_JOBS`, `DTENSOR_CLIENT_ID`, `DTENSOR_JOB_NAME`, as
the launcher gives a worker). It builds the mesh the way a run does
(`tfllm.parallel.mesh.build_mesh`, one axis over every device of every client: on GPUs
NCCL's collectives, on CPUs TensorFlow's ring collectives over gRPC), then all-reduces a
buffer of each size per device a few times and prints one JSON line:

    {"device_type": "GPU", "devices": 16, "client": 0, "results": [{"bytes": 8388608,
     "seconds": 0.0004, "algbw_gbs": 21.0, "busbw_gbs": 39.4}, ...]}

Bandwidths follow nccl-tests' convention: algorithm bandwidth = bytes per device / time,
bus bandwidth = algorithm bandwidth x 2(n-1)/n for n devices (what each link carries in a
ring all-reduce, comparable with the hardware's link speed). Each timed call includes
TensorFlow's dispatch of the collective, so the figures are a lower bound of what NCCL
alone reaches (nccl-tests' all_reduce_perf times NCCL alone).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import List, Mapping, Sequence

from tfllm.doctor import nccl_log

#: the sizes per device the doctor times (nccl-tests' range, cut short: a few seconds)
DEFAULT_SIZES_MB = (8, 32, 128, 256)
MIB = 1 << 20


def bus_bandwidth(algbw: float, devices: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce over `devices` devices: a ring moves
    2(n-1)/n of the buffer over each link."""
    return algbw * 2 * (devices - 1) / devices if devices > 1 else 0.0


def measure(device_type: str, sizes_bytes: Sequence[int], iterations: int,
            warmup: int = 1) -> dict:
    """Times all-reduces (sums) of each size per device over every device of the job.

    Args:
      device_type: GPU or CPU (the mesh's devices; one logical CPU device per client).
      sizes_bytes: the buffer per device, in bytes (a multiple of 4: float32).
      iterations: timed calls per size.
      warmup: untimed calls per size first (the first compiles the function and, on
        GPUs, creates NCCL's communicator).

    Returns:
      The JSON the module prints (see the module docstring).
    """
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from tfllm.contracts import client_id
    from tfllm.parallel.mesh import build_mesh

    mesh = build_mesh("data=-1", device_type, num_cpu_devices=1)
    devices = mesh.size
    # (devices, n): one row per device; the sum over rows is one all-reduce of a row,
    # replicated on every device.
    summed = tf.function(lambda x: tf.reduce_sum(x, axis=0))
    results: List[dict] = []
    for size in sizes_bytes:
        layout = dtensor.Layout(["data", dtensor.UNSHARDED], mesh)
        rows = dtensor.call_with_layout(tf.ones, layout, shape=[devices, size // 4])
        for _ in range(warmup):
            _finished(summed(rows), devices, dtensor)
        start = time.perf_counter()
        for _ in range(iterations):
            out = summed(rows)
        _finished(out, devices, dtensor)  # calls on one device's stream finish in order
        seconds = (time.perf_counter() - start) / iterations
        algbw = size / seconds / 1e9
        results.append({"bytes": size, "seconds": seconds, "algbw_gbs": algbw,
                        "busbw_gbs": bus_bandwidth(algbw, devices)})
    return {"device_type": device_type, "devices": devices, "client": client_id(),
            "results": results}


def _finished(out, devices: int, dtensor) -> None:
    """Waits for `out` by reading one element of this client's first shard; checks that
    it is the sum over every device (each contributed ones)."""
    first = dtensor.unpack(out)[0][:1].numpy()[0]
    if first != devices:
        raise RuntimeError(f"the all-reduce over {devices} devices summed to {first}")


def run_client(jobs: str, rank: int, environ: Mapping[str, str], timeout_s: float,
               device: str = "GPU", sizes_mb: Sequence[float] = DEFAULT_SIZES_MB,
               iterations: int = 5) -> dict:
    """Runs this module as client `rank` of the job `jobs` (DTENSOR_JOBS) in a process of
    its own, with NCCL's connection log on, and reads what it printed.

    Args:
      jobs: every client's host:port, comma separated.
      rank: this client's index in it.
      environ: the environment to run in (NCCL_*, CUDA_VISIBLE_DEVICES, XLA_FLAGS ...).
      timeout_s: the process is killed after this long (an NCCL hang).
      device: GPU (the doctor) or CPU (the same code over TensorFlow's ring collectives).
      sizes_mb, iterations: as `main`'s options.

    Returns:
      `measure`'s JSON plus "transports" and "network" (`tfllm.doctor.nccl_log`), or
      {"error": why} when the process failed or timed out.
    """
    env = dict(environ, DTENSOR_JOBS=jobs, DTENSOR_CLIENT_ID=str(rank),
               DTENSOR_JOB_NAME="doctor", NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
    env.pop("NCCL_DEBUG_FILE", None)  # the log comes back on the process's output
    if device == "GPU" and env.get("TFLLM_DEVICE") == "cpu":
        env.pop("TFLLM_DEVICE")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH"))
                                        if p)
    cmd = [sys.executable, "-m", "tfllm.doctor.allreduce", "--device", device,
           "--sizes-mb", ",".join(map(str, sizes_mb)), "--iterations", str(iterations)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"error": f"the all-reduce did not finish within {timeout_s:g} s (a "
                         "collective that never completes: a peer that cannot connect, "
                         "or NCCL waiting on a blocked network)", **_links(out + err)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = next((json.loads(line) for line in reversed(out.splitlines())
                   if line.startswith('{"device_type"')), None)
    if proc.returncode != 0 or result is None:
        last = [line for line in err.splitlines() if line.strip()][-1:] or ["no output"]
        return {"error": f"the all-reduce process exited with {proc.returncode}: "
                         f"{last[0][-300:]}", **_links(out + err)}
    return dict(result, **_links(out + err))


def _links(log: str) -> dict:
    return {"transports": nccl_log.transports(log), "network": nccl_log.network(log)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfllm.doctor.allreduce",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("GPU", "CPU"), default="GPU")
    parser.add_argument("--sizes-mb", default=",".join(map(str, DEFAULT_SIZES_MB)),
                        help="Buffer sizes per device, in MiB (fractions allowed).")
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(float(s) * MIB) // 4 * 4 for s in args.sizes_mb.split(",") if s]
    print(json.dumps(measure(args.device, sizes, args.iterations)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
