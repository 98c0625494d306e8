"""The files XLA's GPU compiler needs on a node, found where XLA looks for them.

XLA compiles a GPU cluster to PTX with LLVM, linking CUDA's math library `libdevice.10.bc`,
then to machine code with `ptxas`. It looks for both under a list of CUDA roots
(`tsl::CandidateCudaRoots`, XLA's `cuda_root_path.cc`): the directory of
`XLA_FLAGS=--xla_gpu_cuda_data_dir=DIR` first, then the `nvidia-cuda-nvcc` wheel beside
TensorFlow's (site-packages/nvidia/cuda_nvcc, what `pip install tensorflow[and-cuda]`
brings), the copy some TensorFlow wheels carry (tensorflow/cuda), the CUDA toolkit at
/usr/local/cuda and /opt/cuda, and a conda environment's prefix. libdevice is
`ROOT/nvvm/libdevice/libdevice.10.bc`; ptxas is taken from PATH first, else `ROOT/bin`.
Without libdevice the first compiled GPU step fails ("libdevice not found at
./libdevice.10.bc").

A toolkit elsewhere (`CUDA_DIR`, `CUDA_HOME`, a versioned /usr/local/cuda-12.4) is not
among them: found only there, the report names the `XLA_FLAGS` setting that points XLA
at it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shlex
import shutil
from typing import Dict, List, Mapping, Optional, Sequence

LIBDEVICE = os.path.join("nvvm", "libdevice", "libdevice.10.bc")
DATA_DIR_FLAG = "--xla_gpu_cuda_data_dir"
#: the system CUDA roots XLA itself tries
SYSTEM_ROOTS = ("/usr/local/cuda", "/opt/cuda")
#: toolkits XLA does not look in by itself (only reported with the fix)
OTHER_ROOT_VARIABLES = ("CUDA_DIR", "CUDA_HOME", "CUDA_PATH")
OTHER_ROOT_GLOBS = ("/usr/local/cuda-*",)


def tensorflow_dir() -> Optional[str]:
    """TensorFlow's package directory, found without importing it."""
    spec = importlib.util.find_spec("tensorflow")
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def data_dir_flag(environ: Mapping[str, str]) -> Optional[str]:
    """The directory of `--xla_gpu_cuda_data_dir` in XLA_FLAGS (the last one wins)."""
    found = None
    for word in shlex.split(environ.get("XLA_FLAGS", "")):
        if word.startswith(DATA_DIR_FLAG + "="):
            found = word.split("=", 1)[1]
    return found


def candidate_roots(environ: Mapping[str, str], tf_dir: Optional[str],
                    system_roots: Sequence[str] = SYSTEM_ROOTS) -> List[str]:
    """The CUDA roots XLA tries, in its order (see the module docstring).

    Args:
      environ: the environment (XLA_FLAGS).
      tf_dir: TensorFlow's package directory (site-packages/tensorflow), or None.
      system_roots: the toolkit locations (a test passes fake ones).
    """
    roots = []
    flag = data_dir_flag(environ)
    if flag:
        roots.append(flag)
    if tf_dir:
        site = os.path.dirname(tf_dir)
        roots += [os.path.join(site, "nvidia", "cuda_nvcc"), os.path.join(tf_dir, "cuda")]
    roots += list(system_roots)
    if tf_dir:  # a conda environment: site-packages is PREFIX/lib/pythonX.Y/site-packages
        roots.append(os.path.normpath(os.path.join(tf_dir, "..", "..", "..", "..")))
    return roots


def other_roots(environ: Mapping[str, str],
                patterns: Sequence[str] = OTHER_ROOT_GLOBS) -> List[str]:
    """Toolkits XLA does not look in: the CUDA_DIR-like variables, versioned installs."""
    roots = [environ[v] for v in OTHER_ROOT_VARIABLES if environ.get(v)]
    for pattern in patterns:
        roots += sorted(glob.glob(pattern), reverse=True)  # newest version first
    return roots


def libdevice(environ: Mapping[str, str], tf_dir: Optional[str],
              system_roots: Sequence[str] = SYSTEM_ROOTS,
              other_patterns: Sequence[str] = OTHER_ROOT_GLOBS) -> Dict[str, object]:
    """Where XLA will find libdevice.10.bc.

    Returns:
      {"found": the file XLA uses or None, "searched": the roots XLA tries, "elsewhere":
      a toolkit with libdevice that XLA does not look in (or None), "flag_missing": the
      XLA_FLAGS directory when it lacks libdevice (XLA then falls back to the others)}.
    """
    roots = candidate_roots(environ, tf_dir, system_roots)
    found = next((os.path.join(r, LIBDEVICE) for r in roots
                  if os.path.isfile(os.path.join(r, LIBDEVICE))), None)
    flag = data_dir_flag(environ)
    elsewhere = None
    if not found:
        elsewhere = next((r for r in other_roots(environ, other_patterns)
                          if os.path.isfile(os.path.join(r, LIBDEVICE))), None)
    return {"found": found, "searched": roots, "elsewhere": elsewhere,
            "flag_missing": flag if flag and not os.path.isfile(os.path.join(flag, LIBDEVICE))
            else None}


def libdevice_finding(result: Mapping[str, object], gpu: bool) -> Optional[tuple]:
    """(level, message) for a node's `libdevice` result: an error on a GPU node without
    it, a note (ok) on a CPU node, a warning for an XLA_FLAGS directory without it."""
    found, elsewhere = result.get("found"), result.get("elsewhere")
    if not gpu:
        return ("ok", "no GPU: XLA's libdevice is not needed here"
                      + (f" (found {found})" if found else ""))
    if found and result.get("flag_missing"):
        return ("warning", f"XLA_FLAGS={DATA_DIR_FLAG}={result['flag_missing']} has no "
                           f"{LIBDEVICE}; XLA falls back to {found}: fix or drop the flag")
    if found:
        return ("ok", f"XLA's libdevice: {found}")
    fix = (f"set XLA_FLAGS={DATA_DIR_FLAG}={elsewhere} (the toolkit there has it; XLA does "
           "not look there by itself)" if elsewhere else
           "pip install 'tensorflow[and-cuda]' (its nvidia-cuda-nvcc wheel has it), or set "
           f"XLA_FLAGS={DATA_DIR_FLAG}=DIR to a CUDA toolkit with {LIBDEVICE}")
    return ("error", f"no {os.path.basename(LIBDEVICE)} where XLA looks "
                     f"({', '.join(str(r) for r in result.get('searched', []))}): every "
                     f"compiled GPU step would fail; {fix}")


def ptxas(environ: Mapping[str, str], tf_dir: Optional[str],
          system_roots: Sequence[str] = SYSTEM_ROOTS) -> Optional[str]:
    """The ptxas XLA runs: PATH first, else a candidate root's bin/ptxas."""
    found = shutil.which("ptxas", path=environ.get("PATH"))
    if found:
        return found
    return next((os.path.join(r, "bin", "ptxas") for r in candidate_roots(
        environ, tf_dir, system_roots) if os.path.isfile(os.path.join(r, "bin", "ptxas"))),
                None)
