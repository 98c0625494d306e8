"""Meshes, sharding rules, layouts and variable placement (the Keras 3 <-> DTensor bridge)."""

from tfllm.parallel.context import constrain, current, use
from tfllm.parallel.rules import DEFAULT_RULES, ShardingError, resolve_spec, zero1_spec


def make_parallel(config):
    """Builds the mesh and `Parallel` setup a config describes."""
    from tfllm.parallel.mesh import build_mesh
    from tfllm.parallel.placement import Parallel
    from tfllm.parallel.rules import rules_from_config
    mesh = build_mesh(config.mesh.axes, config.mesh.device_type, config.mesh.num_cpu_devices)
    return Parallel(mesh, rules_from_config(config.mesh.rules),
                    config.optimizer.shard_optimizer_state)
