"""The HLO modules XLA compiles in this process, captured with `--xla_dump_to`.

TensorFlow offers no API for the HLO of the XLA clusters its clustering pass builds inside
a DTensor program, so the cost report reads XLA's own dump. XLA reads `XLA_FLAGS` once,
at its first compilation in the process (measured, TF 2.21: a flag set after one
`jit_compile` function has run is ignored), so `start()` must run before anything
compiles with XLA: before the model is built (on GPU its initializers are XLA functions).
A dump started too late is not an error; the report then says the FP8 counts were not
measured.

Everything XLA compiles in the process is dumped, the step's clusters and later programs
(evaluation, generation) alike, with the backend's extra files (LLVM IR and objects on
CPU). The dump goes to a private temporary folder that `stop()` (and the end of the
process) removes, unless `XLA_FLAGS` already names a `--xla_dump_to`, which is then read
and left alone.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
from typing import Dict, Iterable, List, Optional, Tuple

from tfllm import files
from tfllm.compiler.fp8_hlo import fp8_dot_counts

_DUMP_TO = re.compile(r"--xla_dump_to[= ](\S+)")
_MODULE = re.compile(r"^module_\d+\.(.+)\.before_optimizations\.txt$")


class HloDump:
    """A folder where XLA writes the modules it compiles.

    Args:
      directory: XLA's `--xla_dump_to`.
      owned: tfllm made the folder (and removes it); False for the user's own dump.
      previous_flags: `XLA_FLAGS` before `start()` (None: unset), restored by `close()`.
    """

    def __init__(self, directory: str, owned: bool, previous_flags: Optional[str]):
        self.directory, self.owned, self.previous_flags = directory, owned, previous_flags

    def modules(self, names: Iterable[str], since: float) -> Dict[str, List[str]]:
        """{name: [HLO text before optimizations]} of the named programs, compiled since
        `since` (time.time()). A name is a cluster's function ('cluster_12') or a
        `jit_compile` function's ('__inference__train_step_42'); a dump holds one module
        per name and compilation (two when compiled again with other shapes)."""
        wanted = {name.lstrip("_"): name for name in names}
        found: Dict[str, List[str]] = {name: [] for name in wanted.values()}
        for path in sorted(glob.glob(os.path.join(self.directory,
                                                  "*before_optimizations.txt"))):
            match = _MODULE.match(os.path.basename(path))
            if not match or os.path.getmtime(path) < since - 1.0:  # older: another run
                continue
            # XLA names a module after its function, with "a_" for a leading underscore
            # and the function's attributes after "__" ("cluster_5__XlaCompiledKernel_...").
            module = match.group(1)
            module = module[2:] if module.startswith("a_") else module
            key = module.split("__", 1)[0] if module.startswith("cluster_") else next(
                (k for k in wanted if module.startswith(k + "__")), None)
            if key in wanted:
                with open(path, encoding="utf-8") as f:
                    found[wanted[key]].append(f.read())
        return found

    def close(self) -> None:
        """Restores `XLA_FLAGS` (child processes must not dump) and removes the folder
        tfllm made. XLA keeps the flags it read: later compilations recreate the folder,
        which the end of the process removes."""
        if self.previous_flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = self.previous_flags
        if self.owned:
            files.remove_tree(self.directory, ignore_errors=True)


_current: Optional[HloDump] = None


def start() -> HloDump:
    """Asks XLA to dump what it compiles in this process (idempotent); returns the dump.

    Call before the first XLA compilation of the process: XLA reads its flags then.
    """
    global _current
    if _current is not None:
        return _current
    flags = os.environ.get("XLA_FLAGS")
    given = _DUMP_TO.search(flags or "")
    if given:
        _current = HloDump(given.group(1), owned=False, previous_flags=flags)
    else:
        directory = files.new_temporary_folder("tfllm-hlo-")
        atexit.register(files.remove_tree, directory, ignore_errors=True)
        # Only --xla_dump_to: XLA aborts the process on a flag it does not know, and
        # text, the format read here, is its default.
        os.environ["XLA_FLAGS"] = ((flags + " ") if flags else "") + f"--xla_dump_to={directory}"
        _current = HloDump(directory, owned=True, previous_flags=flags)
    return _current


def current() -> Optional[HloDump]:
    """The dump `start()` requested and `stop()` has not ended, or None."""
    return _current


def stop() -> None:
    """Ends the dump: `XLA_FLAGS` restored, tfllm's folder removed."""
    global _current
    if _current is not None:
        _current.close()
        _current = None


def fp8_gemms(dump: Optional[HloDump], names: List[str],
              since: float) -> Tuple[Optional[Dict[str, int]], str]:
    """FP8 GEMM candidates of the named programs' modules, and a note.

    Returns:
      ({"full", "half", "none"} dot counts summed over the modules, or None when not
      measured; a note saying why not, or which programs' modules were missing).
    """
    if not names:
        return None, "no XLA program"
    if dump is None:
        return None, "no HLO dump: tfllm.compiler.hlo_dump.start() was not called"
    modules = dump.modules(names, since)
    missing = [name for name, texts in modules.items() if not texts]
    if len(missing) == len(names):
        return None, ("XLA dumped none of the step's programs: XLA had compiled before the "
                      "dump was requested in this process (it reads XLA_FLAGS once), or "
                      "XLA_FLAGS limits the dump")
    counts = {"full": 0, "half": 0, "none": 0}
    for texts in modules.values():
        for text in texts[:1]:  # the first compilation: the step's shapes
            found = fp8_dot_counts(text)
            for key in counts:
                counts[key] += found[key]
    note = f"modules of {len(missing)} of {len(names)} programs missing" if missing else ""
    return counts, note
