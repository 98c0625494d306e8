"""Every private TensorFlow, Keras, keras-hub and jax API tfllm uses, fenced in this module.

Nothing else in tfllm imports `tensorflow.python`, `keras.src`, `keras_hub.src` or
`jax._src`, reaches into another library's private attributes, or matches the names of
ops TensorFlow generates: it calls a function here. Each function checks that the
internal it needs exists and fails with one message naming the library, the versions
tfllm was written for (`WRITTEN_FOR`, the one table; setup.py bounds the same ranges) and
the fix, instead of an AttributeError deep inside a run. Where a whole release range is
known to hold the internals, the installed version is checked against the table before
the first use (`check_keras` before model placement, `jax_compiler` before a compile).

The libraries are imported inside the functions, not at the top: this module sits on the
ground floor, and `tfllm plan`'s compile child and the GPU step runner import it in
processes that have jax but no TensorFlow.

What is fenced:
* TensorFlow: XLA's lazy-compilation switch (`set_xla_lazy_compilation`), the executed
  graphs of a block (`collect_executed_graphs`), the eager context's coordination
  service (`eager_context`), the names DTensor's SPMD expansion gives the ops it inserts
  (`is_dtensor_op_name`), whether ops being built will be compiled by XLA
  (`in_xla_context`), XLA's optimization barrier (`optimization_barrier`).
* Keras (the Keras <-> DTensor bridge): `Variable._value` (`is_allocated`),
  `Variable._initializer/_initialize` (`adopt`), `Layer._flatten_layers` (`all_layers`), the deferred-initialization list in
  `keras.src.backend.common.global_state` (`forget_deferred`, `abstract_backbone`),
  `SafeModeScope` (`safe_mode`), the saver's object-graph walk (`h5_locations`).
* keras-hub (pretrained import/export): `preset_loader`, `recording_safetensor_loader`,
  `export_hf_tokenizer`.
* jax (deviceless GPU compiles): `jax_compiler`.
"""

from __future__ import annotations

import contextlib
import re
import types

#: library -> (oldest (major, minor), newest (major, minor) or None for "through major.x")
WRITTEN_FOR = {"tensorflow": ((2, 16), (2, 21)), "keras": ((3, 5), None),
               "keras_hub": ((0, 20), None), "jax": ((0, 10), (0, 10))}
#: libraries whose internals were checked against these exact releases only (within the
#: range above): jax's compile-only client changes its signatures between patch releases
EXACT_RELEASES = {"jax": ("0.10.2",)}
#: what to install when a version is outside its range
_INSTALL = {"tensorflow": "'tensorflow>=2.16,<2.22'", "keras": "'keras>=3.5,<4'",
            "keras_hub": "'keras-hub>=0.20,<1'", "jax": "the plan extra (pip install -e '.[plan]')"}
_NAMES = {"tensorflow": "TensorFlow", "keras": "Keras", "keras_hub": "keras-hub", "jax": "jax"}


def _version(text: str):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _range(library: str) -> str:
    if library in EXACT_RELEASES:
        return ", ".join(EXACT_RELEASES[library])
    low, high = WRITTEN_FOR[library]
    top = f"{high[0]}.{high[1]}" if high else f"{low[0]}.x"
    return f"{low[0]}.{low[1]}-{top}"


def _installed(library: str) -> str:
    import importlib
    return importlib.import_module(library).__version__


def check_version(library: str, version: str = None) -> None:
    """Raises RuntimeError naming the supported range when `library` is outside it.

    Args:
      library: a key of `WRITTEN_FOR`.
      version: the version to check (default: the installed one).
    """
    version = version or _installed(library)
    low, high = WRITTEN_FOR[library]
    have = _version(version)
    if (have < low or (high and have > high) or (not high and have[0] != low[0])
            or version not in EXACT_RELEASES.get(library, (version,))):
        raise RuntimeError(f"{_NAMES[library]} {version} is not supported: tfllm uses its "
                           f"internals as written for {_NAMES[library]} {_range(library)}; "
                           f"install {_INSTALL[library]}.")


def _missing(library: str, what: str) -> RuntimeError:
    return RuntimeError(f"{_NAMES[library]} {_installed(library)} lacks {what}, which tfllm "
                        f"uses (written for {_NAMES[library]} {_range(library)}); install "
                        f"{_INSTALL[library]}.")


# ---- TensorFlow ------------------------------------------------------------------------
def _tensorflow_internal(module: str, name: str):
    """`module.name` of TensorFlow's internals, or the one-line error of a TensorFlow that
    lacks the module or the name."""
    import importlib
    try:
        found = importlib.import_module(module)
    except ImportError:
        raise _missing("tensorflow", module) from None
    value = getattr(found, name, None)
    if value is None:
        raise _missing("tensorflow", f"{module}.{name}")
    return value


def set_xla_lazy_compilation(enabled: bool) -> None:
    """TF_XLA_FLAGS' --tf_xla_enable_lazy_compilation, settable after start-up."""
    _tensorflow_internal("tensorflow.python.pywrap_tfe",
                         "TF_SetXlaEnableLazyCompilation")(bool(enabled))


def eager_context():
    """TensorFlow's eager context: its coordination service (key-value store, barriers)
    is what DTensor's multi-client runtime started (`tfllm.runtime.coordination`)."""
    try:
        from tensorflow.python.eager import context
    except ImportError:
        raise _missing("tensorflow", "tensorflow.python.eager.context") from None
    return context.context()


def in_xla_context() -> bool:
    """Whether the ops being built now will be compiled by XLA (inside a
    `tf.function(jit_compile=True)`, or a function it calls): ops that only XLA runs
    (a bf16 x bf16 -> float32 matmul) may be used there and nowhere else."""
    import tensorflow as tf
    check = _tensorflow_internal("tensorflow.python.ops.control_flow_util",
                                 "GraphOrParentsInXlaContext")
    return bool(check(tf.compat.v1.get_default_graph()))


def optimization_barrier(*tensors):
    """XLA's optimization barrier (`XlaOptimizationBarrier`) of `tensors`: the same
    tensors, each available only once all of them are computed; nothing is fused across
    it and it moves no data. Only inside an XLA compile (`in_xla_context`)."""
    return _tensorflow_internal("tensorflow.compiler.tf2xla.python.xla",
                                "optimization_barrier")(*tensors)

# Names of the ops DTensor's SPMD expansion inserts: the reshapes and slices around its
# collectives and relayouts, and ops it rewrites (an AssignAdd into read, add and assign;
# one_hot into slices). TF 2.21 suffixes every op it creates with "_968192538".
_DTENSOR_OP_NAME = re.compile(r"DTensor|CombinedReduce|[Rr]elayout|_968192538(_|$)")


def is_dtensor_op_name(name: str) -> bool:
    """Whether an executed graph's node `name` is one DTensor's SPMD expansion created."""
    return bool(_DTENSOR_OP_NAME.search(name))


@contextlib.contextmanager
def collect_executed_graphs():
    """Collects the graphs of functions instantiated inside the block.

    Yields a callable that returns the post-optimization GraphDefs (after TensorFlow's
    graph passes, XLA clustering included): what the runtime really executes.
    """
    from google.protobuf import message
    ctx = eager_context()
    for name in ("enable_graph_collection", "enable_run_metadata", "export_run_metadata",
                 "disable_graph_collection", "disable_run_metadata"):
        if not hasattr(ctx, name):
            raise _missing("tensorflow", f"eager context.{name}")
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
        # afterwards, for the rest of the process (tests/test_internals.py).
        ctx.disable_run_metadata()
        ctx.disable_graph_collection()
        if metadata is not None:
            graphs.extend(fg.post_optimization_graph for fg in metadata.function_graphs)


# ---- Keras: the Keras <-> DTensor bridge ---------------------------------------------
def check_keras(version: str = None) -> None:
    """Raises RuntimeError naming the supported range when Keras is outside it or lacks
    the bridge's internals."""
    import keras
    check_version("keras", version)
    if not hasattr(keras.Variable, "_initialize"):
        raise _missing("keras", "Variable._initialize")


def is_allocated(var) -> bool:
    """Whether the Keras variable already holds a value."""
    return getattr(var, "_value", None) is not None


def all_layers(model) -> list:
    """Every layer of `model`, nested ones included, the model first (Keras 3 lists only
    the top level publicly)."""
    if not hasattr(model, "_flatten_layers"):
        raise _missing("keras", "Layer._flatten_layers")
    return list(model._flatten_layers())


def adopt(var, backend_variable) -> None:
    """Makes `backend_variable` (a tf.Variable or DVariable) the Keras variable's value."""
    var._initializer = None
    var._initialize(backend_variable)


def _global_state():
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        raise _missing("keras", "keras.src.backend.common.global_state") from None
    return global_state


def forget_deferred(done) -> None:
    """Removes `done` from Keras' list of variables awaiting deferred initialization."""
    global_state = _global_state()
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    ids = {id(v) for v in done}
    global_state.set_global_attribute("uninitialized_variables",
                                      [v for v in pending if id(v) not in ids])


def safe_mode():
    """A scope in which Keras deserializes in its default safe mode (no Python lambdas, no
    file paths in a config) even after `keras.config.enable_unsafe_deserialization()` in
    this process, which otherwise overrides even an explicit `safe_mode=True`.

    keras-hub's `Tokenizer.from_preset` takes no `safe_mode` (its kwargs become the
    tokenizer's constructor arguments); it deserializes the preset's tokenizer.json with
    Keras' default, then loads the preset's own vocabulary files (fixed names inside the
    preset) outside safe mode. So the scope resets the process-wide switch to "not set"
    (`SafeModeScope(None)`), not to True: True would also refuse those files.
    """
    try:
        from keras.src.saving.serialization_lib import SafeModeScope
    except ImportError:
        raise _missing("keras",
                       "keras.src.saving.serialization_lib.SafeModeScope") from None
    return SafeModeScope(None)


def abstract_backbone(cls, kwargs: dict):
    """`cls(**kwargs)` built under a stateless scope: variables with paths and shapes,
    no values (a llama-70b backbone costs no memory)."""
    import keras
    global_state = _global_state()
    before = list(global_state.get_global_attribute("uninitialized_variables") or [])
    with keras.StatelessScope(initialize_variables=False):
        backbone = cls(**kwargs)
    # Keras would initialize these at the next stateful scope exit; they never will be.
    global_state.set_global_attribute("uninitialized_variables", before)
    return backbone


def h5_locations(layer) -> dict:
    """{variable path: dataset path in `layer.save_weights(...)`'s .h5 file}.

    Keras names the file's groups by the object graph (attribute names and class
    names), not by variable paths; its own saver computes them, so ask it with a store
    that records instead of writing.
    """
    try:
        from keras.src.saving import saving_lib
        _save_state, store_cls = saving_lib._save_state, saving_lib.H5IOStore
    except (ImportError, AttributeError):
        raise _missing("keras", "keras.src.saving.saving_lib._save_state / H5IOStore") from None

    class _Entry(dict):
        def __init__(self, owner, path):
            super().__init__()
            self.owner, self.path = owner, path

        def __setitem__(self, key, value):
            group = f"{self.path}/vars" if self.path else "vars"
            self.owner.found[value.path] = f"{group}/{key}"

    class _Recorder(store_cls):
        def __init__(self):  # no file: nothing is written
            self.found = {}

        def __bool__(self):  # H5IOStore asks its (absent) file
            return True

        def make(self, path, metadata=None):
            return _Entry(self, path)

    recorder = _Recorder()
    _save_state(layer, weights_store=recorder, assets_store=None, inner_path="",
                visited_saveables=set())
    return recorder.found


# ---- keras-hub: pretrained import and export ------------------------------------------
def preset_loader(preset: str):
    """keras-hub's `PresetLoader` for a local preset or Hugging Face directory."""
    try:
        from keras_hub.src.utils.preset_utils import get_preset_loader
    except ImportError:
        raise _missing("keras_hub",
                       "keras_hub.src.utils.preset_utils.get_preset_loader") from None
    return get_preset_loader(preset)


def recording_safetensor_loader(preset: str):
    """A keras-hub `SafetensorLoader` whose `port_weight` records (key, hook, shape) per
    variable path in `.ported` instead of assigning."""
    try:
        from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader
    except ImportError:
        raise _missing("keras_hub",
                       "keras_hub.src.utils.transformers.safetensor_utils") from None

    class RecordingSafetensorLoader(SafetensorLoader):
        def __init__(self, preset):
            super().__init__(preset)
            self.ported = {}

        def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
            self.ported[keras_variable.path] = (hf_weight_key, hook_fn,
                                                tuple(int(n) for n in keras_variable.shape))

    return RecordingSafetensorLoader(preset)


def export_hf_tokenizer(tokenizer, out: str) -> None:
    """keras-hub's writer of a Hugging Face tokenizer folder (raises ValueError for a
    tokenizer class it cannot write)."""
    try:
        from keras_hub.src.utils.transformers.export import hf_exporter
    except ImportError:
        raise _missing("keras_hub",
                       "keras_hub.src.utils.transformers.export.hf_exporter") from None
    hf_exporter.export_tokenizer(tokenizer, out)


# ---- jax: compile-only GPU clients -----------------------------------------------------
def jax_compiler():
    """The jax internals a deviceless compile needs, after checking jax is there and the
    release they were checked against: a namespace with `ir` (MLIR), `native` (jaxlib's
    `_jax`: `DeviceList`, `mlir.hlo_to_stablehlo`), `make_ir_context` and `CompileOptions`.
    """
    try:
        import jax
    except ImportError:
        raise ImportError("planning needs jax and its CUDA plugin: "
                          "pip install -e '.[plan]'") from None
    try:
        check_version("jax", jax.__version__)
    except RuntimeError as error:
        raise ImportError(str(error)) from None
    try:
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib import _jax, xla_client
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import hlo
    except ImportError:
        raise _missing("jax", "jax._src.lib / jax._src.interpreters.mlir") from None

    def portable_stablehlo(module) -> bytes:
        """`module` as a StableHLO portable artifact of a version at least 4 weeks old
        (what jax.export itself writes: readable by jax releases of the next months)."""
        version = hlo.get_version_from_compatibility_requirement(
            hlo.StablehloCompatibilityRequirement.WEEK_4)
        return _jax.mlir.serialize_portable_artifact(module, version, False)

    return types.SimpleNamespace(ir=ir, native=_jax, make_ir_context=jax_mlir.make_ir_context,
                                 CompileOptions=xla_client.CompileOptions,
                                 portable_stablehlo=portable_stablehlo)
