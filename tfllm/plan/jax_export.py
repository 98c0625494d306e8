"""The exported train step as a `jax.export` artefact: runs with any recent jax, no TensorFlow.

`tfllm export-step` writes `step.hlo.pb`, TensorFlow's XLA program. Running that HLO takes
jaxlib internals that change between releases (`tfllm.internals.jax_compiler` is pinned to
the plan extra's jax), and the GPU machines lent to this project carry another jax. A
serialized `jax.export.Exported` is jax's own portable format: a StableHLO portable
artifact (versioned; StableHLO guarantees that later releases read it) plus the argument
and result types. Written here with the pinned jax, it is read on the GPU machine with
public APIs only (`jax.export.deserialize`, `jax.jit(exported.call)`;
benchmarks/gpu/run_step.py).

The artefact names the CUDA platform and disables jax's platform check, so the same file
also runs on a CPU (tests/plan/test_export_step.py runs it there). The program is
TensorFlow's before any backend pass, so it carries no platform-specific custom call.
"""

from __future__ import annotations

from tfllm import internals
from tfllm.plan.gpu_compile import hlo_to_mlir

# MLIR element types -> numpy/ml_dtypes names (the step's parameters and results)
_DTYPES = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
           "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2", "i64": "int64",
           "i32": "int32", "i16": "int16", "i8": "int8", "ui8": "uint8", "ui32": "uint32",
           "i1": "bool"}
CALLING_CONVENTION = 9  # the oldest jax.export reads in 0.10: the widest window


def _avals(jx, module):
    """(argument avals, result avals) of the module's `main`."""
    import jax
    import jax.numpy as jnp
    main = next(op for op in module.body.operations
                if str(op.attributes["sym_name"]).strip('"') == "main")
    ftype = jx.ir.FunctionType(jx.ir.TypeAttr(main.attributes["function_type"]).value)

    def aval(t):
        t = jx.ir.RankedTensorType(t)
        name = str(t.element_type)
        if name not in _DTYPES:
            raise ValueError(f"the step has a {name} value, which jax.export cannot describe "
                             "here; export the HLO only (step.hlo.pb)")
        return jax.core.ShapedArray(tuple(t.shape), jnp.dtype(_DTYPES[name]))

    return tuple(map(aval, ftype.inputs)), tuple(map(aval, ftype.results))


def exported_step(hlo_proto: bytes, name: str = "tfllm_train_step") -> bytes:
    """The serialized `jax.export.Exported` of an HLO train step (see the module docstring).

    Args:
      hlo_proto: a serialized HloModuleProto (what `export-step` writes as step.hlo.pb).
      name: the function name the artefact records.
    """
    jx = internals.jax_compiler()
    from jax import export, tree_util
    with jx.make_ir_context():
        module = hlo_to_mlir(hlo_proto)
        in_avals, out_avals = _avals(jx, module)
        blob = jx.portable_stablehlo(module)
    n, k = len(in_avals), len(out_avals)
    exported = export.Exported(
        fun_name=name, in_tree=tree_util.tree_structure((tuple(range(n)), {})),
        in_avals=in_avals, out_tree=tree_util.tree_structure(tuple(range(k))),
        out_avals=out_avals, _has_named_shardings=True, _in_named_shardings=(None,) * n,
        _out_named_shardings=(None,) * k, in_shardings_hlo=(None,) * n,
        out_shardings_hlo=(None,) * k, nr_devices=1, platforms=("cuda",),
        ordered_effects=(), unordered_effects=(),
        disabled_safety_checks=(export.DisabledSafetyCheck.platform(),),
        mlir_module_serialized=blob, calling_convention_version=CALLING_CONVENTION,
        module_kept_var_idx=tuple(range(n)), uses_global_constants=False, _get_vjp=None)
    return bytes(exported.serialize())
