"""GPU targets that `tfllm plan` compiles for, and the figures its roofline model uses.

Every number comes from XLA's own target descriptions of each chip
(`xla/backends/gpu/target_config/specs/*.txtpb` in openxla/xla), except where a comment
says otherwise:

* `device_memory_size`, `memory_bandwidth`, `core_count`, `clock_rate_ghz`, shared memory
  and L2 sizes: copied from the spec's `gpu_device_info`.
* Dense tensor-core peaks: the spec's `matrix_unit_description` gives, per XLA element type,
  `units_per_core * ops_per_clock` fused multiply-adds per clock at `clock_rate_ghz`; one
  multiply-add is 2 FLOPs, so peak = 2 * core_count * units * ops * clock. For the H100 SXM
  this gives 989.2 TFLOP/s bf16 and 1978.3 TFLOP/s FP8 (NVIDIA's datasheet: 989.4, 1978.9).
* The A100 spec has no matrix-unit table: its bf16 peak (312 TFLOP/s dense) is NVIDIA's A100
  datasheet figure, and it has no FP8 tensor cores (FP8 GEMMs fall back to bf16 there).

The text proto given to jaxlib's compile-only client holds the `gpu_device_info` fields
that jaxlib 0.10's `GpuTargetConfigProto` reads (the rate tables are left out: the
compiler does not need them, and the peaks are kept here instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class Target:
    """One GPU as XLA's spec describes it.

    Args:
      name: the `--target` name.
      description: the spec's `device_description_str`.
      spec_file: the XLA spec it is taken from.
      device_memory_bytes: usable device memory as the driver reports it.
      memory_bandwidth: HBM bytes/s.
      bf16_flops: dense bf16 tensor-core FLOP/s.
      fp8_flops: dense FP8 tensor-core FLOP/s (None: no FP8 tensor cores).
      tf32_flops: dense TF32 tensor-core FLOP/s, for float32 GEMMs (TensorFlow enables
        TF32 by default, and its dots reach XLA with default precision).
      core_count, fpus_per_core, clock_rate_ghz, shared_memory_per_core,
      shared_memory_per_block_optin, l2_cache_size, compute_capability, feature_extension,
      pcie_bandwidth: copied into the compiler's target description.
    """

    name: str
    description: str
    spec_file: str
    device_memory_bytes: int
    memory_bandwidth: float
    bf16_flops: float
    fp8_flops: Optional[float]
    tf32_flops: float
    core_count: int
    fpus_per_core: int
    clock_rate_ghz: float
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    l2_cache_size: int
    compute_capability: int
    feature_extension: str

    def target_config(self) -> str:
        """The `GpuTargetConfigProto` text for jaxlib's compile-only CUDA client."""
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {self.compute_capability}
    feature_extension: {self.feature_extension}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  runtime_version: "12.8.0"
  dnn_version: "9.10.0"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
}}
device_description_str: "{self.description}"
"""

    def gemm_flops(self, dtype: str) -> float:
        """Dense GEMM peak for operands of `dtype` (an HLO element type)."""
        if dtype.startswith("f8") and self.fp8_flops:
            return self.fp8_flops
        if dtype in ("bf16", "f16", "f8e4m3fn", "f8e5m2"):
            return self.bf16_flops
        return self.tf32_flops


def _tensor_peak(cores: int, clock_ghz: float, units: int, ops_per_clock: int) -> float:
    """FLOP/s from an XLA matrix-unit rate (multiply-adds per clock; 2 FLOPs each)."""
    return 2.0 * cores * units * ops_per_clock * clock_ghz * 1e9


# Hopper: matrix units clocked at 1.8295201 GHz, 4 per SM; bf16 512 and FP8 1024 FMA/clock;
# TF32 (spec key 11, float32 operands): 256 FMA/clock.
_HOPPER = dict(core_count=132, fpus_per_core=128, clock_rate_ghz=1.98,
               shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
               l2_cache_size=52428800, compute_capability=9,
               feature_extension="ACCELERATED_FEATURES",
               bf16_flops=_tensor_peak(132, 1.8295201, 4, 512),
               fp8_flops=_tensor_peak(132, 1.8295201, 4, 1024),
               tf32_flops=_tensor_peak(132, 1.8295201, 4, 256))

TARGETS: Dict[str, Target] = {
    "h100": Target("h100", "NVIDIA H100 80GB HBM3", "h100_sxm.txtpb",
                   device_memory_bytes=84942979072, memory_bandwidth=3.35232e12, **_HOPPER),
    "h200": Target("h200", "NVIDIA H200 141GB HBM3e", "h200.txtpb",
                   device_memory_bytes=151397597184, memory_bandwidth=4.8e12, **_HOPPER),
    # Blackwell: 148 SMs; matrix units at 1.8353101 GHz, bf16 1024, FP8 2048, TF32 512 FMA/clock.
    "b200": Target("b200", "NVIDIA B200", "b200.txtpb", device_memory_bytes=191514411008,
                   memory_bandwidth=7.67232e12,
                   bf16_flops=_tensor_peak(148, 1.8353101, 4, 1024),
                   fp8_flops=_tensor_peak(148, 1.8353101, 4, 2048),
                   tf32_flops=_tensor_peak(148, 1.8353101, 4, 512), core_count=148,
                   fpus_per_core=128,
                   clock_rate_ghz=1.965, shared_memory_per_core=233472,
                   shared_memory_per_block_optin=232448, l2_cache_size=132644864,
                   compute_capability=10, feature_extension="ACCELERATED_FEATURES"),
    # A100 SXM 80 GB: no matrix-unit table in the spec; 312 TFLOP/s bf16 and 156 TFLOP/s
    # TF32 (dense) are NVIDIA's A100 datasheet figures.
    "a100": Target("a100", "NVIDIA A100-SXM4-80GB", "a100_sxm_80.txtpb",
                   device_memory_bytes=85100068864, memory_bandwidth=2.03904e12,
                   bf16_flops=312e12, fp8_flops=None, tf32_flops=156e12, core_count=108,
                   fpus_per_core=64, clock_rate_ghz=1.41, shared_memory_per_core=167936,
                   shared_memory_per_block_optin=166912, l2_cache_size=41943040,
                   compute_capability=8, feature_extension="NONE"),
}


def get_target(name: str) -> Target:
    """The target called `name`; a ValueError lists the known ones."""
    try:
        return TARGETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown --target {name!r}; known targets: "
                         f"{', '.join(sorted(TARGETS))}") from None
