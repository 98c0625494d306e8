"""Executes the notebooks through a real Jupyter kernel, stores them, and checks them.

Maintainers re-execute and store every notebook (or the ones named) with

    python -m tests.notebooks.execute [notebooks/NN_name.ipynb ...]

and check without writing with `--check` (what the slow test does); `--check --kernels
eigen` (or avx512) checks them with the kernels another x86 CPU would run. A stored notebook
carries, in `metadata.tfllm`, the hash of its code cells at execution time: editing a
code cell without re-executing makes the notebook stale, and `tests/notebooks` fails.

What "the same outputs" means (`compare`): per code cell, the kinds of output (a figure
must still be a figure) and the text outputs (stdout and `text/plain` results; stderr is
never stored) line by line, each line judged by tests/notebooks/figures.py: words,
shapes, integers and claims exactly, decimals within 2%, and the figures that depend on
the CPU's kernels by what they measure. A cell tagged `nondeterministic` (timings,
process ids) is compared by the kinds of output it makes, not by its text.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import sys
import time
from importlib.metadata import version

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

from tests.notebooks import figures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
COMMAND = "python -m tests.notebooks.execute"

# A bound for hangs, not a speed limit (docs/testing.md, "A busy machine"): at least 5 times
# the slowest notebook measured on 2 cores with two CPU-bound processes beside it.
NOTEBOOK_BUDGET_S = 1500
MAX_BYTES = 1_000_000  # stored size, figures included
NONDETERMINISTIC = "nondeterministic"  # cell tag: compare output kinds, not text


def notebooks() -> list:
    """Every notebook, in order."""
    return sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))


def code_hash(nb) -> str:
    """sha256 of the code cells' sources, in order (what an execution depends on)."""
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
               for c in nb["cells"] if c["cell_type"] == "code"]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


# Settings that change numerics, which the kernel must not inherit: the tests' conftest
# turns oneDNN off, and bfloat16 then rounds differently from what a user's kernel (and
# the stored outputs) computed.
_NOT_INHERITED = ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA", "XLA_FLAGS", "TF_XLA_FLAGS")

# Kernels that stand, on this machine, for other x86 CPUs (`--kernels`): to check that
# outputs stored on one CPU pass on another. oneDNN dispatches on the CPU's instruction set
# at run time (ONEDNN_MAX_CPU_ISA caps it), XLA's CPU backend likewise (xla_cpu_max_isa).
# TensorFlow 2.21 picks oneDNN's float16 and bfloat16 kernels by what the CPU has, whatever
# oneDNN may use: a cap below AVX512_CORE_FP16 on a CPU with AVX512_FP16 (or below
# AVX512_CORE_BF16 on one with AVX512_BF16) makes a float16 (bfloat16) matmul die with
# SIGSEGV, so the caps stop there.
KERNELS = {
    "native": {},
    # AVX-512 without AMX (Intel Ice Lake and Cascade Lake, AMD EPYC Zen 4 and 5)
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16", "XLA_FLAGS": "--xla_cpu_max_isa=AVX512"},
    # oneDNN off (TF_ENABLE_ONEDNN_OPTS=0, as a user may set it; TensorFlow on CPUs that are
    # not x86, and by default on x86 CPUs without AVX-512 VNNI/BF16, AVX-VNNI or AMX):
    # Eigen's kernels, and XLA capped at AVX2 as on a CPU without AVX-512. TensorFlow's
    # plain CPU allocator records no allocations there (oneDNN's does), so notebook 01's
    # memory profile runs on the BFC allocator that `start_notebook` picks.
    "eigen": {"TF_ENABLE_ONEDNN_OPTS": "0", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2"},
}


@contextlib.contextmanager
def kernel_environment(kernels: str = "native"):
    """The kernel inherits os.environ: quiet TensorFlow, fixed hashing, CPU only, and
    TensorFlow's own defaults for the settings that change numerics, or those of
    `KERNELS[kernels]`."""
    wanted = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONHASHSEED": "0", "CUDA_VISIBLE_DEVICES": "",
              "KERAS_BACKEND": "tensorflow", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    saved = {k: os.environ.get(k) for k in (*wanted, *_NOT_INHERITED)}
    os.environ.update(wanted)
    for k in _NOT_INHERITED:
        os.environ.pop(k, None)
    os.environ.update(KERNELS[kernels])
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class NotebookTimeout(CellTimeoutError):
    """A notebook ran past its budget: names the cell that was running and how long the
    notebook had run."""


def timeout_message(name: str, cell_number: int, source: str, ran_s: float,
                    cell_s: float, budget_s: float) -> str:
    """The one line a timed-out notebook fails with."""
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return (f"{name}: code cell {cell_number} ({first[:80]!r}) was still running after "
            f"{cell_s:.0f} s; the notebook had run {ran_s:.0f} s of its {budget_s:g} s "
            "budget, a bound for hangs (tests/notebooks/execute.py: NOTEBOOK_BUDGET_S). "
            "Look for a cell that waits on something that never comes.")


def execute(path: str, budget_s: float = NOTEBOOK_BUDGET_S, kernels: str = "native"):
    """Runs a notebook from a fresh kernel in notebooks/; returns (executed nb, seconds).

    `kernels` names the CPU kernels it runs with (`KERNELS`; "native": this CPU's own).

    Raises nbclient's CellExecutionError (with the cell and traceback) when a cell
    fails, and NotebookTimeout (naming the cell and the time run) when the notebook runs
    past `budget_s` in all.
    """
    nb = nbformat.read(path, as_version=4)
    deadline = time.monotonic() + budget_s
    running = {}  # the code cell being executed: its number and start

    def cell_started(cell, cell_index):  # called for every cell, markdown too
        if cell.cell_type != "code":
            return
        codes = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        running.update(number=codes.index(cell_index) + 1, source=cell.source,
                       start=time.monotonic())

    client = NotebookClient(
        nb, kernel_name="python3", record_timing=False, allow_errors=False,
        # One bound for the whole notebook: each cell gets what is left of it.
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        on_cell_start=cell_started, resources={"metadata": {"path": NOTEBOOK_DIR}})
    start = time.monotonic()
    with kernel_environment(kernels):
        try:
            client.execute()
        except CellTimeoutError as e:
            now = time.monotonic()
            raise NotebookTimeout(timeout_message(
                os.path.basename(path), running.get("number", 0), running.get("source", ""),
                now - start, now - running.get("start", start), budget_s)) from e
    seconds = time.monotonic() - start
    return _finish(nb, seconds, kernels), seconds


def cpu_model() -> str:
    """This machine's CPU, as /proc/cpuinfo names it ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        return ""
    return names[0] if names else ""


def _finish(nb, seconds: float, kernels: str = "native"):
    """Drops stderr (warnings differ by machine) and stamps what was executed."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs
                            if not (o.output_type == "stream" and o.name == "stderr")]
    nb.metadata["tfllm"] = {"code_sha256": code_hash(nb), "seconds": round(seconds, 1),
                            "tensorflow": version("tensorflow"), "keras": version("keras"),
                            "cpu": cpu_model(), "kernels": kernels}
    return nb


def text_lines(cell) -> list:
    """The text a code cell shows: stdout, and text/plain of results and displays.

    Consecutive stdout outputs are joined first: the kernel may cut one print in two
    when its flush timer fires in the middle of it.
    """
    text = ""
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream" and o["name"] == "stdout":
            text += "".join(o["text"]) if isinstance(o["text"], list) else o["text"]
        elif o["output_type"] in ("execute_result", "display_data"):
            if "image/png" in o["data"]:
                continue  # its text/plain is "<Figure size ...>": the figure is checked
            plain = o["data"].get("text/plain", "")
            plain = "".join(plain) if isinstance(plain, list) else plain
            text += ("\n" if text and not text.endswith("\n") else "") + plain + "\n"
    return [line.rstrip() for line in text.splitlines()]


def output_kinds(cell) -> list:
    """What a code cell makes: 'stdout', 'figure', 'result' (errors never get stored)."""
    kinds = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            kind = o["name"]
        elif "image/png" in o.get("data", {}):
            kind = "figure"
        else:
            kind = "result"
        if kind != "stderr" and (not kinds or kinds[-1] != kind):
            kinds.append(kind)
    return kinds


def compare(stored, fresh, measured: tuple = ()) -> list:
    """Differences between a stored notebook and a fresh execution of it ([] if none).

    Args:
      stored, fresh: the notebooks.
      measured: the notebook's kernel-dependent lines (`figures.rules(path)`).
    """
    problems = []
    pairs = [(s, f) for s, f in zip(stored["cells"], fresh["cells"]) if s["cell_type"] == "code"]
    for number, (s, f) in enumerate(pairs, start=1):
        where = f"code cell {number}"
        if output_kinds(s) != output_kinds(f):
            problems.append(f"{where}: stored outputs {output_kinds(s)}, "
                            f"a fresh execution makes {output_kinds(f)}")
            continue
        if NONDETERMINISTIC in s.get("metadata", {}).get("tags", []):
            continue
        a, b = text_lines(s), text_lines(f)
        for i, (x, y) in enumerate(zip(a, b)):
            why = figures.judge(x, y, measured)
            if why:
                problems.append(f"{where}, line {i + 1}: stored {x!r}, fresh {y!r}: {why}")
        if len(a) != len(b):
            problems.append(f"{where}: stored {len(a)} lines of text, fresh {len(b)}")
    return problems


def stored_problems(path: str) -> list:
    """What is wrong with a stored notebook without running it ([] if nothing)."""
    name = os.path.basename(path)
    fix = f"re-execute and store it: {COMMAND} notebooks/{name}"
    size = os.path.getsize(path)
    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata.get("tfllm", {})
    problems = []
    if size > MAX_BYTES:
        problems.append(f"{name} is {size} bytes, over {MAX_BYTES}: make its figures "
                        "smaller (dpi) or fewer")
    if stamp.get("code_sha256") != code_hash(nb):
        problems.append(f"{name}: its code changed since it was executed (or it never "
                        f"was); {fix}")
    counts = [c.get("execution_count") for c in nb.cells if c.cell_type == "code"]
    if counts != list(range(1, len(counts) + 1)):
        problems.append(f"{name}: its cells were not executed once each, in order, from a "
                        f"fresh kernel (execution counts {counts}); {fix}")
    for number, c in enumerate((c for c in nb.cells if c.cell_type == "code"), start=1):
        if any(o.output_type == "error" for o in c.outputs):
            problems.append(f"{name}, code cell {number}: an error is stored; {fix}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Execute notebooks through a Jupyter kernel and store them "
        "with their outputs (all when none is named).")
    parser.add_argument("paths", nargs="*", help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--budget", type=float, default=NOTEBOOK_BUDGET_S,
                        help="seconds a notebook may run in all (default %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="execute and compare with the stored outputs; write nothing")
    parser.add_argument("--kernels", choices=sorted(KERNELS), default="native",
                        help="run with the CPU kernels another x86 CPU would use (with "
                        "--check: do outputs stored here pass there?); default %(default)s")
    args = parser.parse_args(argv)
    if args.kernels != "native" and not args.check:
        parser.error("--kernels goes with --check: notebooks are stored as this CPU runs them")
    paths = [os.path.abspath(p) for p in args.paths] or notebooks()
    failed = False
    for path in paths:
        if not os.path.isfile(path):
            print(f"{path}: no such notebook", file=sys.stderr)
            return 2
        fresh, seconds = execute(path, args.budget, args.kernels)  # reads; writes nothing
        name = os.path.relpath(path, ROOT)
        if args.check:
            stored = nbformat.read(path, as_version=4)
            problems = stored_problems(path) + compare(stored, fresh, figures.rules(path))
            failed |= bool(problems)
            print(f"{name}: {seconds:.0f} s, " + ("; ".join(problems) or "up to date"))
            continue
        tmp = path + ".tmp"
        nbformat.write(fresh, tmp)  # written whole, then renamed: never half a notebook
        os.replace(tmp, path)
        print(f"{name}: executed in {seconds:.0f} s, {os.path.getsize(path)} bytes stored")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
