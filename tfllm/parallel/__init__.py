"""Meshes, sharding rules, layouts and variable placement (the Keras 3 <-> DTensor bridge).

Floor 2 (imports the runtime and the ground floor). Owns the rules table (`rules`: which
mesh axis each logical axis takes, and a batch's layout, `batch_layout`), the meshes laid
over the devices the runtime set up (`mesh`; `tfllm.runtime.devices`), the mesh context
model code sees (`context`) and how weights are placed and gathered (`placement`, `fsdp`).
Batches are placed by `tfllm.data.feed`; agreement between clients is
`tfllm.runtime.coordination`'s.
"""

from tfllm.parallel.context import constrain, current, use
from tfllm.parallel.rules import DEFAULT_RULES, ShardingError, resolve_spec, zero1_spec


def make_parallel(config):
    """Builds the mesh and `Parallel` setup a config describes."""
    from tfllm.parallel.mesh import build_mesh
    from tfllm.parallel.placement import Parallel
    from tfllm.parallel.rules import mesh_axes_of, rules_from_config
    rules = rules_from_config(config.mesh.rules)
    mesh = build_mesh(config.mesh.axes, config.mesh.device_type, config.mesh.num_cpu_devices,
                      known=mesh_axes_of(rules),
                      gpu_memory_reserve_mb=config.mesh.gpu_memory_reserve_mb,
                      gpu_allocator=config.mesh.gpu_allocator)
    return Parallel(mesh, rules,
                    config.optimizer.shard_optimizer_state,
                    int(config.mesh.gradient_bucket_mb * 2 ** 20),
                    attention_recomputed=config.model.remat in ("attention", "selective"))
