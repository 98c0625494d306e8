"""A plan as a value: what `tfllm.plan.planner.plan` returns and its renderings read.

`PlanResult` is frozen and typed: the compiled program's figures (`program`, as the HLO
counter and the compile give them), the device's memory (`Memory`), the mesh device's
figures beside the compile (`tfllm.plan.sharded.MeshFigures`, None on one device), the
step-time estimate (`StepEstimate`), the fit model's cross-check and where each figure
comes from. `to_json` writes the layout `tfllm plan --json` has always written (stored
plans under benchmarks/results/ are in it) and `from_json` reads it back, so a stored
plan re-times and renders as a fresh one (`benchmarks/retime_plan.py`).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping, Optional

from tfllm.footprint.layout import BlockBuffers, Gradients
from tfllm.plan.sharded import Collectives, MeshFigures, MeshMemory

#: the compiled memory parts (bytes), XLA's buffer assignment of the program
_COMPILED = ("arguments", "outputs", "alias", "temp", "total")


@dataclasses.dataclass(frozen=True)
class Memory:
    """One device's memory in bytes: the compile's parts with the mesh's corrections
    (`total`), against what the target gives TensorFlow.

    Attributes:
      arguments, outputs, alias, temp: XLA's buffer assignment of the compiled program;
        on a mesh the state's arguments, outputs and aliases are the layout's exact bytes.
      total: arguments + outputs - alias + temp (+ block buffers - subtracted gradients
        on a mesh).
      device: the target's memory; reserve: mesh.gpu_memory_reserve_mb in bytes;
      usable: device - reserve; margin: usable - total; fits: margin >= 0.
      total_low: with one micro-batch on a mesh, the total with every gradient byte of
        excess subtracted (a lower bound), else None.
    """
    arguments: int
    outputs: int
    alias: int
    temp: int
    total: int
    device: int
    reserve: int
    usable: int
    margin: int
    fits: bool
    total_low: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The step time (`tfllm.plan.timing`) and what follows from it.

    Attributes:
      roofline_step_s: the roofline plus the collectives no prefetch can hide.
      step_time: `tfllm.plan.timing.step_time`'s parts and factors.
      step_s, tokens_per_s: the estimated step and its tokens per second (all devices).
      mfu: model FLOPs against the dense bf16 peak.
    """
    roofline_step_s: float
    step_time: Mapping[str, Any]
    step_s: float
    tokens_per_s: float
    mfu: float


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A plan of one device for a GPU target.

    Attributes:
      program: the compiled program's figures: FLOPs, bytes, kernels, GEMM calls,
        roofline, compile time, parameters, model FLOPs, tokens per step (one device's
        share) and the like (`tfllm.compiler.hlo_stats.summarize` and the export).
      memory: the device's memory (`Memory`).
      mesh: the mesh device's figures (`MeshFigures`), None on one device.
      estimate: the step-time estimate.
      fit: the fit model's arithmetic of the same config (`tfllm.footprint.fit`), or None.
      sources: where each figure comes from, in words.
      identity: the target, device, peaks, model, policy, batch and method.
    """
    program: Mapping[str, Any]
    memory: Memory
    mesh: Optional[MeshFigures]
    estimate: StepEstimate
    fit: Optional[Mapping[str, Any]]
    sources: Mapping[str, str]
    identity: Mapping[str, Any]

    def __post_init__(self):
        for name in ("program", "fit", "sources", "identity"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, types.MappingProxyType(dict(value)))

    @property
    def devices(self) -> int:
        return self.mesh.devices if self.mesh else 1

    @property
    def method(self) -> str:
        return self.identity["method"]

    @property
    def compile_s(self) -> float:
        return self.program["compile_s"]

    def to_json(self) -> dict:
        """The plan as `tfllm plan --json` writes it (plain types only)."""
        memory = {k: getattr(self.memory, k) for k in _COMPILED}
        out = dict(self.program)
        out["memory"] = memory
        if self.mesh is not None:
            mesh, mm = self.mesh, self.mesh.memory
            out["devices"], out["mesh"] = mesh.devices, mesh.note
            memory["gather_buffers"] = mm.buffers.bytes
            memory["gather_detail"] = {k: v for k, v in mm.buffers.as_json().items()
                                       if k != "bytes"}
            if mm.block_buffers is not None:
                memory["block_buffers"] = mm.block_buffers
                memory["block_program"] = dict(mm.block_program)
                if mm.counted != mm.block_buffers:
                    memory["block_buffers_counted"] = mm.counted
            memory["gradients"] = mm.gradients.as_json()
            memory["state_difference"] = mm.state_difference
            if self.memory.total_low is not None:
                memory["total_low"] = self.memory.total_low
            out["batch_shards"] = mesh.batch_shards
            out["collectives"] = mesh.collectives.as_json()
            if mesh.collectives_assumed is not None:
                out["collectives_assumed"] = mesh.collectives_assumed.as_json()
            out["collective_s"] = mesh.collectives.seconds
            out["blocks"], out["overlappable"] = mesh.blocks, mesh.overlappable
            out["collective_count"], out["clusters"] = mesh.collective_count, mesh.clusters
            if mesh.clusters_basis:
                out["clusters_basis"] = mesh.clusters_basis
            out["optimizer_update"] = dict(mesh.optimizer_update)
            out["method_note"] = ("estimate from per-device shapes: DTensor gives XLA many "
                                  "clusters per device, not one program")
        else:
            out["devices"], out["mesh"] = 1, "one device"
        memory.update(device=self.memory.device, reserve=self.memory.reserve,
                      usable=self.memory.usable, margin=self.memory.margin,
                      fits=self.memory.fits)
        if self.fit is not None:
            out["fit"] = dict(self.fit)
        out["sources"] = dict(self.sources)
        e = self.estimate
        out.update(roofline_step_s=e.roofline_step_s, step_time=dict(e.step_time),
                   estimated_step_s=e.step_s, estimated_tokens_per_s=e.tokens_per_s,
                   estimated_mfu=e.mfu)
        out.update(self.identity)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PlanResult":
        """A plan `to_json` wrote (or `tfllm plan --json` stored)."""
        m = d["memory"]
        mesh = None
        if d.get("devices", 1) > 1:
            detail = m.get("gather_detail") or {}
            buffers = BlockBuffers(bytes=m.get("gather_buffers", 0),
                                   **{k: detail[k] for k in ("gathered", "gradient",
                                                             "partials", "unit")
                                      if k in detail})
            g = m.get("gradients") or {"program": 0, "device": 0, "excess": 0,
                                       "subtracted": 0}
            block_buffers = m.get("block_buffers")
            counted = m.get("block_buffers_counted",
                            block_buffers if block_buffers is not None else buffers.bytes)
            assumed = d.get("collectives_assumed")
            mesh = MeshFigures(
                devices=d["devices"], note=d["mesh"],
                memory=MeshMemory(state_difference=m.get("state_difference", 0),
                                  gradients=Gradients(**g), buffers=buffers,
                                  block_program=m.get("block_program"),
                                  block_buffers=block_buffers, counted=counted),
                collectives=Collectives.from_json(d["collectives"]),
                collectives_assumed=Collectives.from_json(assumed) if assumed else None,
                collective_count=d.get("collective_count", 0),
                clusters=d.get("clusters", 1), clusters_basis=d.get("clusters_basis"),
                blocks=d.get("blocks", 0), overlappable=d.get("overlappable", False),
                batch_shards=d.get("batch_shards", 1),
                optimizer_update=d.get("optimizer_update") or {})
        memory = Memory(**{k: m[k] for k in _COMPILED}, device=m["device"],
                        reserve=m["reserve"], usable=m["usable"], margin=m["margin"],
                        fits=m["fits"], total_low=m.get("total_low"))
        estimate = StepEstimate(d["roofline_step_s"], d["step_time"], d["estimated_step_s"],
                                d["estimated_tokens_per_s"], d["estimated_mfu"])
        identity = {k: d[k] for k in IDENTITY if k in d}
        skip = set(IDENTITY) | set(_MESH_KEYS) | set(_ESTIMATE_KEYS) | {
            "memory", "fit", "sources"}
        program = {k: v for k, v in d.items() if k not in skip}
        return cls(program=program, memory=memory, mesh=mesh, estimate=estimate,
                   fit=d.get("fit"), sources=d.get("sources", {}), identity=identity)


#: the identification keys of a plan's JSON
IDENTITY = ("target", "device", "peaks", "model", "policy", "global_batch_size",
            "grad_accum_steps", "sequence_length", "method", "cost_source")
_MESH_KEYS = ("devices", "mesh", "batch_shards", "collectives", "collectives_assumed",
              "collective_s", "blocks", "overlappable", "collective_count", "clusters",
              "clusters_basis", "optimizer_update", "method_note")
_ESTIMATE_KEYS = ("roofline_step_s", "step_time", "estimated_step_s",
                  "estimated_tokens_per_s", "estimated_mfu")
