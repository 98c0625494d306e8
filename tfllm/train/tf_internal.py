"""The private TensorFlow APIs tfllm's XLA support uses, fenced in one place.

Written for TensorFlow 2.16-2.21 (setup.py bounds the version). Each function checks
that the internal it needs exists and fails with a message naming the TensorFlow
version otherwise, instead of an AttributeError deep inside a training run.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from google.protobuf import message
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context

_WRITTEN_FOR = "2.16-2.21"


def _missing(what: str) -> RuntimeError:
    return RuntimeError(f"TensorFlow {tf.__version__} lacks {what}, which tfllm's XLA support "
                        f"uses (written for TensorFlow {_WRITTEN_FOR}); install a version "
                        "in that range or set train.jit_compile=false.")


def set_xla_lazy_compilation(enabled: bool) -> None:
    """TF_XLA_FLAGS' --tf_xla_enable_lazy_compilation, settable after start-up."""
    setter = getattr(pywrap_tfe, "TF_SetXlaEnableLazyCompilation", None)
    if setter is None:
        raise _missing("pywrap_tfe.TF_SetXlaEnableLazyCompilation")
    setter(bool(enabled))


@contextlib.contextmanager
def collect_executed_graphs():
    """Collects the graphs of functions instantiated inside the block.

    Yields a callable that returns the post-optimization GraphDefs (after TensorFlow's
    graph passes, XLA clustering included): what the runtime really executes.
    """
    ctx = context.context()
    for name in ("enable_graph_collection", "enable_run_metadata", "export_run_metadata",
                 "disable_graph_collection", "disable_run_metadata"):
        if not hasattr(ctx, name):
            raise _missing(f"eager context.{name}")
    try:
        ctx.export_run_metadata()  # drop what an earlier block may have left
    except message.DecodeError:
        # The runtime hands its store over (and empties it) before Python parses it,
        # so it is dropped either way; what someone else collected can be too large
        # for protobuf to parse (over 2 GB).
        pass
    ctx.enable_graph_collection()
    ctx.enable_run_metadata()
    graphs = []
    try:
        yield lambda: list(graphs)
    finally:
        metadata = ctx.export_run_metadata()
        # In this order: disabling graph collection first and run metadata second
        # leaves TensorFlow (2.21) storing the graph of every function instantiated
        # afterwards, for the rest of the process (tests/train/test_tf_internal.py).
        ctx.disable_run_metadata()
        ctx.disable_graph_collection()
        if metadata is not None:
            graphs.extend(fg.post_optimization_graph for fg in metadata.function_graphs)
