"""Start-up checks of a GPU host: what the driver lists against what TensorFlow can use.

`tfllm doctor` prints every finding; every run whose mesh is on GPUs (or `auto` on a host
whose driver lists GPUs) runs the same checks first and stops at an error with one line
naming the fix, instead of hanging in a minutes-long JIT compile, training on the CPU
without a word, or running an FP8 recipe without FP8 GEMMs.

The checks are pure functions of `HostFacts`, so each is tested with faked listings;
`gather()` reads the real ones (nvidia-smi, TensorFlow's build info and devices, the CUDA
libraries of the `tensorflow[and-cuda]` wheels).
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

# The TensorFlow versions tfllm is written for (setup.py bounds them); its GPU paths
# (DTensor's NCCL lowering, the XLA flags) are read against these.
TESTED_TF = ((2, 16), (2, 21))
# Oldest Linux driver of each CUDA 12 release (NVIDIA's CUDA toolkit release notes,
# table 3): PTX from toolkit 12.x can only be JIT-compiled by a driver at least this new.
_MIN_DRIVER = {(12, 0): 525, (12, 1): 530, (12, 2): 535, (12, 3): 545, (12, 4): 550,
               (12, 5): 555, (12, 6): 560, (12, 8): 570, (12, 9): 575}
# The CUDA libraries TensorFlow's GPU build opens at start-up (`dso_loader`); a missing
# one makes TensorFlow skip every GPU with a warning that a quiet start hides.
_LIBRARIES = ("libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcufft.so.11",
              "libcusolver.so.11", "libcusparse.so.12", "libcudnn.so.9", "libnccl.so.2")
# A JIT cache smaller than TensorFlow's PTX keeps evicting it (the default is 256 MiB).
_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class Gpu:
    """One GPU as the driver lists it (nvidia-smi)."""

    name: str
    compute_capability: Tuple[int, int]
    driver: str


@dataclass
class HostFacts:
    """What the checks read.

    Args:
      driver_gpus: the GPUs nvidia-smi lists (empty without a driver).
      tf_gpus: the GPUs TensorFlow lists.
      tf_version: TensorFlow's version string.
      build: `tf.sysconfig.get_build_info()`.
      library_errors: CUDA library -> why it did not load (only failures).
      environ: the process environment.
    """

    driver_gpus: List[Gpu]
    tf_gpus: int
    tf_version: str
    build: Dict[str, object]
    library_errors: Dict[str, str] = field(default_factory=dict)
    environ: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """One result: `level` is error, warning or ok."""

    level: str
    message: str


def _version(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _machine_code(build: dict, cc: Tuple[int, int]) -> str:
    """'sass' when the build has machine code for `cc`, 'ptx' when only PTX the driver
    must JIT-compile, '' when neither."""
    caps = [str(c) for c in build.get("cuda_compute_capabilities", [])]
    major, minor = cc
    if f"sm_{major}{minor}" in caps:
        return "sass"
    ptx = [c for c in caps if c.startswith("compute_")]
    return "ptx" if any(int(c[len("compute_"):]) <= major * 10 + minor for c in ptx) else ""


def check(facts: HostFacts, precision_policy: str = "float32",
          requested: str = "auto") -> List[Finding]:
    """The findings for a run of `precision_policy` on `requested` (mesh.device_type)."""
    found: List[Finding] = []
    add = lambda level, message: found.append(Finding(level, message))
    gpus = facts.driver_gpus
    tf_version = _version(facts.tf_version)
    if gpus and not (TESTED_TF[0] <= tf_version <= TESTED_TF[1]):
        add("error", f"TensorFlow {facts.tf_version} is outside the range tfllm is written "
                     f"for on GPUs (2.16-2.21); pip install 'tensorflow[and-cuda]>=2.16,<2.22'.")
    if not gpus:
        if requested == "GPU":
            add("error", "mesh.device_type=GPU, but the NVIDIA driver lists no GPU (nvidia-smi "
                         "is missing or finds none); run on a GPU host or set "
                         "mesh.device_type=CPU.")
        else:
            add("ok", "no GPU: meshes run on the CPU")
        return found
    if not facts.build.get("is_cuda_build"):
        add("error", f"the driver lists {len(gpus)} GPU(s) but this TensorFlow is a CPU build; "
                     "pip install 'tensorflow[and-cuda]' (or set mesh.device_type=CPU).")
        return found
    if facts.tf_gpus == 0:
        why = "; ".join(f"{lib}: {err}" for lib, err in sorted(facts.library_errors.items()))
        add("error", f"the driver lists {len(gpus)} GPU(s) but TensorFlow sees none"
                     + (f" (failed to load {why})" if why else "")
                     + "; pip install 'tensorflow[and-cuda]' in this environment (it brings "
                       "the CUDA libraries), or set mesh.device_type=CPU to run on the CPU.")
    elif facts.tf_gpus < len(gpus) and not facts.environ.get("CUDA_VISIBLE_DEVICES"):
        add("warning", f"TensorFlow sees {facts.tf_gpus} of the {len(gpus)} GPUs the driver "
                       "lists")
    cuda = _version(str(facts.build.get("cuda_version", "12.0")))
    need = _MIN_DRIVER.get(cuda, 525)
    for gpu in sorted(set(gpus), key=lambda g: g.name):
        cc = "%d.%d" % gpu.compute_capability
        code = _machine_code(facts.build, gpu.compute_capability)
        driver = _version(gpu.driver)
        if not code:
            add("error", f"{gpu.name} (compute capability {cc}) is older than every GPU this "
                         f"TensorFlow is built for ({', '.join(facts.build.get('cuda_compute_capabilities', []))}); "
                         "use a newer GPU.")
        elif code == "ptx" and driver and driver[0] < need:
            add("error", f"driver {gpu.driver} is too old for {gpu.name}: TensorFlow has only "
                         f"CUDA {'.'.join(map(str, cuda))} PTX for compute capability {cc}, "
                         f"which needs driver R{need} or newer to compile "
                         "(CUDA_ERROR_UNSUPPORTED_PTX_VERSION at the first kernel); update "
                         "the NVIDIA driver.")
        elif code == "ptx":
            size = int(facts.environ.get("CUDA_CACHE_MAXSIZE", "0") or 0)
            if not facts.environ.get("CUDA_CACHE_PATH") or size < _CACHE_BYTES:
                add("warning", f"TensorFlow has no machine code for {gpu.name} (compute "
                               f"capability {cc}), only PTX: the driver JIT-compiles its "
                               "kernels at start-up, for minutes, at every cold start unless "
                               "the JIT cache persists; set CUDA_CACHE_PATH to a kept "
                               f"directory and CUDA_CACHE_MAXSIZE={_CACHE_BYTES}.")
            else:
                add("ok", f"{gpu.name}: PTX JIT-compiled once into "
                          f"{facts.environ['CUDA_CACHE_PATH']}")
        elif driver and driver[0] < 525:
            add("error", f"driver {gpu.driver} is older than R525, the oldest that runs CUDA "
                         "12; update the NVIDIA driver.")
        if precision_policy == "fp8" and gpu.compute_capability < (8, 9):
            add("error", f"precision.policy=fp8 needs FP8 tensor cores (compute capability "
                         f"8.9+: Ada, Hopper, Blackwell); {gpu.name} is {cc}, where every "
                         "FP8 GEMM would run as bf16. Use precision.policy=bfloat16.")
    if not any(f.level == "error" for f in found):
        add("ok", f"{facts.tf_gpus} GPU(s) usable: "
                  + ", ".join(sorted({g.name for g in gpus}))
                  + f"; driver {gpus[0].driver}; TensorFlow {facts.tf_version}, "
                    f"CUDA {facts.build.get('cuda_version')}")
    return found


def first_error(findings: Sequence[Finding]) -> Optional[str]:
    return next((f.message for f in findings if f.level == "error"), None)


# ---- reading the real host ---------------------------------------------------------------
def driver_gpus(run=subprocess.run) -> List[Gpu]:
    """The GPUs nvidia-smi lists (name, compute capability, driver); [] without it."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version",
                   "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and "." in parts[1]:
            major, minor = parts[1].split(".", 1)
            gpus.append(Gpu(parts[0], (int(major), int(minor)), parts[2]))
    return gpus


def _library_errors() -> Dict[str, str]:
    """CUDA libraries that fail to load, from the nvidia-* wheels or the system path."""
    import tensorflow as tf
    site = os.path.dirname(os.path.dirname(tf.__file__))
    errors = {}
    for lib in _LIBRARIES:
        candidates = glob.glob(os.path.join(site, "nvidia", "*", "lib", lib)) or [lib]
        try:
            ctypes.CDLL(candidates[0])
        except OSError as e:
            errors[lib] = str(e).split(":")[-1].strip() or "not found"
    return errors


def gather() -> HostFacts:
    """The facts of this host. Lists TensorFlow's physical GPUs, which does not start
    TensorFlow (a mesh can still be built afterwards)."""
    import tensorflow as tf
    gpus = driver_gpus()
    tf_gpus = len(tf.config.list_physical_devices("GPU"))
    build = dict(tf.sysconfig.get_build_info())
    errors = _library_errors() if gpus and not tf_gpus and build.get("is_cuda_build") else {}
    return HostFacts(gpus, tf_gpus, tf.__version__, build, errors, dict(os.environ))


def wanted(requested: str) -> bool:
    """Whether a run with mesh.device_type `requested` checks the GPUs first."""
    return requested == "GPU" or (requested == "auto" and bool(shutil.which("nvidia-smi")))
