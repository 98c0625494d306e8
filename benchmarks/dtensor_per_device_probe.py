"""Can an op that DTensor has no SPMD rule for run per device, on local shards, in a step?

A minimal reproduction, for issue 34 and for reporting upstream. Fused attention on a GPU
is an XLA custom call (`XlaCustomCallV2`) or a StableHLO module (`XlaCallModule`); DTensor
(TensorFlow 2.21) has an SPMD expander for neither. Attention's inputs are sharded over
batch and heads only, so running the op on each device's local shards would be exact.
This script tries every route TensorFlow 2.21's DTensor offers, on 8 logical CPU devices
(mesh data=2, model=4), with an `XlaCallModule` that runs on a CPU: causal attention of
q (B, T, H, D) sharded [data, -, model, -], exported by jax for one device's shard.

Routes and what each does (the JSON printed last; tests/parallel/test_dtensor_limits.py
holds them):

* `plain`: refused. Layout propagation rejects an op without an SPMD expander
  (`layout_propagation_v2.cc`: "does not implement layout propagation").
* `replicated`: DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.XLACALLMODULE registers
  `ReplicatedOpSPMDExpander` for it: the inputs are gathered and every device runs the op
  on the global shapes (exact, and 8 times the work and memory of a shard).
* `parted_*`: a parted operand (`Layout.to_parted()`) makes SPMD expansion skip the op
  (`SkipExpansionForPartedLayout` in spmd_expander.cc) and infer its output's shape from
  the local operands: it would run on each device's shard. But the layout of every value
  computed from a parted one is parted again (`AdjustPartedLayout`), and every op with a
  parted operand skips expansion, `relayout` included, so the local shape is then read as
  the global one: pinning the output to the parted layout or relayouting it to the
  sharded one fails `DTensorLayout`'s divisibility check (2 heads of a shard against the
  4 devices of `model`), and the rest of the step runs unexpanded (a reshape to the
  global shape meets 128 local elements).
* `xla_spmd`: a mesh with `use_xla_spmd=True` (XLA's own partitioner, which handles custom
  calls) is refused for CPU and GPU meshes (`Mesh.__init__`: TPU only).

No route lets the rest of a step use the output of a per-device op, so `model.attention`
cannot call cuDNN on a DTensor mesh with TensorFlow 2.21 (an SPMD expander would have to
be registered in C++, in `SPMDExpanderRegistry`).

Run: python benchmarks/dtensor_per_device_probe.py [route ...]   (needs the plan extra: jax)
"""

from __future__ import annotations

import json
import os
import sys

ROUTES = ("plain", "replicated", "parted_pinned", "parted_to_sharded", "parted_then_step",
          "xla_spmd")
B, T, H, D = 4, 8, 8, 4  # global (batch, length, heads, head_dim)
MESH = (("data", 2), ("model", 4))


def probe(routes) -> dict:
    """Tries `routes` in this process; returns {route: outcome}. The `replicated` route
    needs a process of its own: the variable it sets holds for every later route."""
    if "replicated" in routes:  # read when the op's layout is first propagated
        assert list(routes) == ["replicated"], "run the replicated route alone"
        os.environ["DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.XLACALLMODULE"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla as tf_xla  # the op's only Python API
    from tensorflow.experimental import dtensor

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    mesh = dtensor.create_mesh(list(MESH), device_type="CPU")
    sharded = dtensor.Layout(["data", dtensor.UNSHARDED, "model", dtensor.UNSHARDED], mesh)
    local = (B // 2, T, H // 4, D)  # one device's shard

    def attention(q):  # (b, t, h, d) -> (b, t, h, d): causal, keys = values = queries
        scores = jnp.einsum("bthd,bshd->bhts", q, q) / np.sqrt(D)
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e30)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), q)

    def module_for(shape):  # exported here, outside any tf.function (AutoGraph)
        exported = jax.export.export(jax.jit(attention), platforms=["cpu"])(
            jax.ShapeDtypeStruct(shape, jnp.float32))
        return exported.calling_convention_version, exported.mlir_module_serialized

    modules = {shape: module_for(shape) for shape in ((B, T, H, D), local)}

    def call(x, shape, declared):
        version, module = modules[shape]
        return tf_xla.call_module([x], version=version, module=module, Tout=[tf.float32],
                                  Sout=[declared], platforms=["CPU"])[0]

    x = np.random.default_rng(0).normal(size=(B, T, H, D)).astype(np.float32)
    reference = np.asarray(jax.jit(attention)(x))  # attention is per (batch row, head)
    q = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(x), dtensor.Layout.replicated(mesh, 4)),
                         sharded)
    parted = sharded.to_parted()

    def on_shards(q):  # the op on parted operands: SPMD expansion skips it
        return call(dtensor.relayout(q, parted), local, (None, T, None, D))

    steps = {
        "plain": lambda q: call(q, (B, T, H, D), (B, T, H, D)),
        "replicated": lambda q: call(q, (B, T, H, D), (B, T, H, D)),
        # its output pinned to the parted layout (with nothing fixing that layout, layout
        # propagation refuses the op as in `plain`)
        "parted_pinned": lambda q: dtensor.relayout(on_shards(q), parted),
        "parted_to_sharded": lambda q: dtensor.relayout(on_shards(q), sharded),
        "parted_then_step": lambda q: tf.reshape(on_shards(q), (B, T, H, D)) + q,
    }
    outcomes = {}
    for route in routes:
        try:
            if route == "xla_spmd":
                dtensor.create_mesh(list(MESH), device_type="CPU", use_xla_spmd=True)
                outcomes[route] = {"ok": True}
                continue
            out = tf.function(steps[route])(q)
            layout = dtensor.fetch_layout(out)
            got = out.numpy()
            outcomes[route] = {"ok": True, "layout": layout.to_string().split(", mesh")[0],
                               "local_shape": list(dtensor.unpack(out)[0].shape),
                               "max_error": float(np.abs(got - reference).max())}
        except Exception as e:  # noqa: BLE001 - the outcome is what the probe reports
            outcomes[route] = {"ok": False, "error": type(e).__name__,
                               "message": " ".join(str(e).split())[:400]}
    return outcomes


def main(routes) -> dict:
    """Every route, `replicated` in a process of its own (this script run again)."""
    import subprocess
    # DTensor's defaults: a lowering variable left in the environment changes the outcome
    # (LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2, which tfllm sets for FSDP, fails the
    # replicated route's two-axis gather; see tfllm/parallel/fsdp.py).
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("DTENSOR_") or k.startswith("LOWER_DTENSOR_"))}
    outcomes = {}
    for group in ([r for r in routes if r != "replicated"], [r for r in routes if r == "replicated"]):
        if group:
            out = subprocess.run([sys.executable, __file__, "--here", *group], check=True,
                                 capture_output=True, text=True, timeout=600, env=env).stdout
            outcomes.update(json.loads(out[out.index("{"):]))
    return {r: outcomes[r] for r in routes}


if __name__ == "__main__":
    args = sys.argv[1:]
    here = bool(args) and args[0] == "--here"
    routes = args[1:] if here else (args or list(ROUTES))
    print(json.dumps(probe(routes) if here else main(routes), indent=1))
