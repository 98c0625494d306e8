"""Step functions compiled in one place: XLA or not, in the mesh context, on any mesh.

`tf.function(jit_compile=True)` has no effect on a DTensor mesh: DTensor inlines the
function into its own SPMD program and marks the per-device function it builds with
`_XlaMustCompile=false` (README, "XLA on a DTensor mesh"). What DTensor keeps is the
`_XlaCompile` attribute of each op. `tf.xla.experimental.jit_scope` sets it on every op
the step creates, and TensorFlow's clustering pass (`MarkForCompilationPass`), which runs
whenever a per-device program is instantiated, then groups those ops into XLA clusters
on every device: one device, several devices in one process, one device per process.
The ops DTensor inserts itself (collectives and the reshapes and slices around them)
carry no attribute and stay TensorFlow ops between the clusters.

Strict compilation (`--tf_xla_enable_lazy_compilation=false`) makes the setting
truthful: a cluster that fails to compile is an error, not a silent fallback to
TensorFlow kernels, and every cluster compiles on its first run instead of after a few
TensorFlow runs. What XLA really compiled is read from the executed programs
(`tfllm.compiler.xla`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import tensorflow as tf

from tfllm import internals
from tfllm.parallel import context

# train.jit_compile=auto, by device type: measured in benchmarks/results/cpu_jit.md.
# On the 2-core CPU, XLA clusters of DTensor's per-device programs were no faster than
# plain graphs in fp32 (0.95-1.21x, within noise), slower in bf16 (0.65x), and compiled
# 2-5x longer, so CPU runs use graphs for every precision. On GPU XLA is the point:
# fusion and FP8 GEMMs.
AUTO_JIT = {"GPU": True, "CPU": False}


def resolve_jit(setting: str, device_type: str = "GPU") -> bool:
    """train.jit_compile as a bool: 'true'/'false' as given; 'auto' by device type.

    Args:
      setting: 'auto', 'true' or 'false'.
      device_type: the mesh's device type (CPU or GPU).
    """
    if setting in ("true", "false"):
        return setting == "true"
    return AUTO_JIT.get(device_type, True)


def use_strict_compilation() -> None:
    """Clusters compile on first use, and a failed compilation raises (no silent fallback)."""
    internals.set_xla_lazy_compilation(False)


@contextlib.contextmanager
def scope(enabled: bool):
    """Marks every op created inside for XLA clustering (a no-op when not `enabled`)."""
    if not enabled:
        yield
        return
    with tf.xla.experimental.jit_scope(compile_ops=True, separate_compiled_gradients=False):
        yield


def compile_fn(fn: Callable, parallel, jit_compile: bool):
    """`fn` as a `tf.function`, traced inside `parallel`'s mesh context, that XLA compiles
    when `jit_compile`.

    Without a mesh this is `tf.function(jit_compile=jit_compile)`: one XLA program. On a
    mesh the ops of `fn` are marked for clustering (`scope`), which DTensor preserves.

    Args:
      fn: the Python function to trace (activations inside it are laid out by
        `tfllm.parallel.context.constrain`).
      parallel: the `tfllm.parallel.Parallel` to trace under, or None (one device).
      jit_compile: compile with XLA.
    """
    on_mesh = parallel is not None
    if on_mesh and jit_compile:
        use_strict_compilation()

    # `wraps`: tf.function keys its retracing statistics by the wrapped function's code;
    # without it every compiled step would share `traced`'s and warn of retracing.
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with context.use(parallel), scope(on_mesh and jit_compile):
            return fn(*args, **kwargs)
    # No AutoGraph (as Keras 3's own train functions): the step's control flow is Python
    # over Python values, so converting it only costs tracing time (measured on the tiny
    # CLI run, data=2,model=4: ~8% of its CPU seconds).
    return tf.function(traced, jit_compile=None if on_mesh else jit_compile,
                       autograph=False)


#: fresh traces `Retraced` tries after DTensor's function-name clash
RETRACES = 3


class Retraced:
    """A compiled function that is traced anew when DTensor trips over its own names.

    On a mesh, DTensor (TF 2.21) now and then fails a loop program's first run with
    "Cannot add function 'decode_x_body' because a different function with the same
    name already exists": the function library it registers its expanded loop under
    already holds another version of that name. It happened in about one run in three
    of the sharded generation tests, on different calls each time. A fresh trace gives
    the loop new names; it is retried up to `RETRACES` times, and only for that error.

    Args:
      fn, parallel, jit_compile: as for `compile_fn`.
    """

    def __init__(self, fn: Callable, parallel, jit_compile: bool):
        self._fn, self._parallel, self._jit = fn, parallel, jit_compile
        self.compiled = compile_fn(fn, parallel, jit_compile)
        #: how many times a call was traced anew
        self.retraces = 0

    def __call__(self, *args, **kwargs):
        for attempt in range(RETRACES + 1):
            try:
                return self.compiled(*args, **kwargs)
            except tf.errors.InvalidArgumentError as error:
                if (self._parallel is None or attempt == RETRACES
                        or "a different function with the same name" not in str(error)):
                    raise
                self.compiled = compile_fn(self._fn, self._parallel, self._jit)
                self.retraces += 1

    def get_concrete_function(self, *args, **kwargs):
        """The current trace's concrete function (what `tfllm.compiler.xla.run_and_report`
        reads)."""
        return self.compiled.get_concrete_function(*args, **kwargs)
