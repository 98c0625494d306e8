"""Throughput accounting: FLOPs per token, the peak, MFU, tokens/s.

The one owner of what MFU means: `tfllm train`, `tfllm bench` and `tfllm plan` count the
model's FLOPs with `flops_per_token`, and train and bench divide the rate they achieve
by `mesh_peak`, so the same run reports the same figure.

The convention (MaxText's `calculate_tflops_training_per_device`): 3x the forward pass;
the forward pass is 2 FLOPs per multiply-accumulate of every matmul weight (6N for the
dense part, N = the attention and MLP projections and the LM head; embedding lookups are
gathers and not counted) plus attention's QK^T and AV matmuls over the (query, key) pairs
the mask lets through: T^2/2 per head under the causal mask (half the full T x T, as
MaxText, Megatron-LM and NeMo count it), T*W - W^2/2 in a sliding-window layer of window
W. These are model FLOPs: what standard attention computes and masks away, and what
`model.remat` recomputes, is not counted.

The peak is a GPU's datasheet figure where tfllm knows the GPU, else a matmul timed on
the GPU. MFU is never clamped: above 1 against a datasheet peak it can only be a
counting error, and `Peak.mfu` says so once. A CPU gets no MFU (`NO_CPU_PEAK` says why).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import tensorflow as tf

from tfllm.compiler.targets import TARGETS
from tfllm.families import is_local_layer, is_moe_layer

log = logging.getLogger("tfllm.train")

#: Why a CPU run reports no MFU (bench's peak_source; the display shows "MFU -").
NO_CPU_PEAK = ("none: no MFU on CPU (a CPU has no datasheet peak tfllm can read, and "
               "a peak timed at start-up moved 2x with other work on the host)")


def count_params(model) -> int:
    """Trainable parameters (FP8 amax histories and other state excluded)."""
    return int(sum(math.prod(int(d) for d in v.shape) for v in model.trainable_variables))


def attention_pairs(sequence_length: int, window: int = 0) -> float:
    """The (query, key) pairs of one head a causal mask lets through, as MaxText counts
    them: T^2/2 (half the T x T scores), or T*W - W^2/2 within a sliding window of W
    keys (W = min(window, T); W = T gives T^2/2 again). The exact counts, T(T+1)/2 and
    T*W - W(W-1)/2 (the diagonal counted in full), are T/2 and W/2 pairs more: a
    fraction 1/T of the causal count, at most 1/W of the windowed one.

    Args:
      sequence_length: T.
      window: the sliding window (0: every earlier key).
    """
    T = sequence_length
    W = min(window, T) if window else T
    return T * W - W * W / 2


def flops_per_token(model_config, sequence_length: int, lora_config=None) -> int:
    """Training FLOPs per token: 3x the forward pass (forward + backward), the module's
    convention (rounded to a whole FLOP). With LoRA adapters (`lora_config.rank` > 0) the
    frozen weights get no weight gradient: their matmuls count 2x forward (forward and the
    input gradient), the adapters' 3x.

    Forward = 2 FLOPs per multiply-accumulate over every matmul weight (attention
    projections, MLP, LM head; embedding lookups are free; a mixture of experts' layer
    counts its router and the k experts a token uses) plus, per layer, the score
    (QK^T) and value (AV) matmuls, 2 + 2 FLOPs per head dimension for each (query, key)
    pair the mask lets through (`attention_pairs`: causal T^2/2, halved as MaxText
    counts it; sliding-window layers T*W - W^2/2), over the T tokens of a sequence.
    """
    c = model_config
    heads = c.num_query_heads
    kv = c.num_key_value_heads or heads
    head_dim = c.head_dim or c.hidden_dim // heads
    E, F, L, V, T = c.hidden_dim, c.intermediate_dim, c.num_layers, c.vocab_size, sequence_length
    mlp_matrices = 2 if c.family == "gpt" else 3
    attention_weights = E * heads * head_dim * 2 + E * kv * head_dim * 2
    # A mixture of experts' layer computes its router and k of its experts per token:
    # the active parameters (what the dispatch adds on top is its own cost, not the
    # model's FLOPs, as MaxText and torchtitan count MFU).
    moe = getattr(c, "num_experts", 0)
    active = (E * moe + c.num_experts_per_tok * 3 * E * (c.moe_intermediate_dim or F)
              if moe else 0)
    layers = sum(attention_weights + (active if is_moe_layer(c, i) else mlp_matrices * E * F)
                 for i in range(L))
    pairs = sum(attention_pairs(T, c.sliding_window if is_local_layer(c, i) else 0)
                for i in range(L))
    weights = 2 * (layers + E * V)
    attention = 2 * 2 * pairs * heads * head_dim / T
    if lora_config is None or lora_config.rank <= 0:
        return round(3 * (weights + attention))
    from tfllm.models.lora import targeted
    sizes = {"attention/query": (E, heads * head_dim), "attention/key": (E, kv * head_dim),
             "attention/value": (E, kv * head_dim), "attention/output": (heads * head_dim, E),
             "mlp/gate": (E, F), "mlp/up": (E, F), "mlp/down": (F, E)}
    width = (c.moe_intermediate_dim or F) if moe else F
    expert_sizes = {"mlp/gate": (E, width), "mlp/up": (E, width), "mlp/down": (width, E)}

    def adapter_macs(x) -> int:
        if not x.experts:
            return sum(sum(sizes[p]) for p in x.paths)
        # each of a token's k experts: one A (shared by gate and up), a B per path
        return c.num_experts_per_tok * (expert_sizes[x.paths[0]][0] + sum(
            expert_sizes[p][1] for p in x.paths))
    adapters = 2 * lora_config.rank * sum(
        adapter_macs(x) for layer in targeted(c, lora_config) for x in layer)
    return round(2 * weights + 3 * (attention + adapters))


def measure_matmul_peak(n: int = 2048, repeats: int = 10, dtype=tf.float32,
                        chain: int = 8) -> float:
    """FLOP/s of n x n x n matmuls on the default device (median of `repeats`).

    Each timed call runs `chain` dependent matmuls on the device and returns one element:
    copying an n x n result to the host inside the timed call would time the copy (on a
    GPU, 16 MiB over PCIe takes longer than the matmul) and understate the peak.
    """
    a = tf.random.stateless_normal((n, n), seed=(1, 2), dtype=dtype)
    # Scaled by 1/sqrt(n) so that the chained products keep unit-size entries.
    b = tf.random.stateless_normal((n, n), seed=(3, 4), dtype=dtype) * (n ** -0.5)

    @tf.function
    def chained(x, y):
        for _ in range(chain):
            x = tf.matmul(x, y)
        return x[0, 0]

    float(chained(a, b))  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        float(chained(a, b))
        times.append(time.perf_counter() - start)
    return 2.0 * n ** 3 * chain / statistics.median(times)


def peak_dtype(precision_policy: str):
    """The matmul dtype whose peak MFU is measured against: float32 runs against the
    float32 peak, every mixed policy (bf16, fp16, fp8) against the dense bf16 peak."""
    return tf.float32 if precision_policy == "float32" else tf.bfloat16


# GPU names (as TensorFlow's device details give them) whose datasheet peaks tfllm knows,
# as (substring, substrings that must also be there or None, substrings that exclude,
# target). PCIe and NVL boards of the H100/H200 have lower clocks and peaks than the
# SXM parts of `tfllm.compiler.targets`; they are measured instead.
_DATASHEET_GPUS = (("H100", ("HBM3", "SXM"), ("PCIE", "NVL"), "h100"),
                   ("H200", None, ("NVL",), "h200"),
                   ("B200", None, (), "b200"),
                   ("A100", None, (), "a100"))


def datasheet_peak(device_name: str, precision_policy: str,
                   tf32: bool = True) -> Optional[Tuple[float, str]]:
    """One GPU's dense tensor-core peak for the policy, from `tfllm.compiler.targets`.

    Returns (FLOP/s, description) or None when the GPU is not in the table, or when a
    float32 run has TF32 off (IEEE float32 GEMMs do not use the tensor cores).

    Args:
      device_name: e.g. "NVIDIA H100 80GB HBM3".
      precision_policy: the config's precision.policy; fp8 counts against the bf16 peak,
        as MaxText and torchtitan report it.
      tf32: precision.tf32.
    """
    name = device_name.upper()
    for key, need, exclude, target in _DATASHEET_GPUS:
        if key not in name or any(x in name for x in exclude):
            continue
        if need and not any(x in name for x in need):
            continue
        t = TARGETS[target]
        if precision_policy == "float32":
            return (t.tf32_flops, f"datasheet: {device_name}, dense TF32") if tf32 else None
        return t.bf16_flops, f"datasheet: {device_name}, dense bf16"
    return None


@dataclass
class Peak:
    """The peak MFU is measured against.

    Args:
      flops: FLOP/s of the whole mesh; None where there is none to trust (CPU).
      source: where it comes from ("datasheet: ...", "measured: ..." or "none: ...").
      measured: whether it was timed in this process.
      warned: set by the one warning of an MFU above 1.
    """

    flops: Optional[float]
    source: str
    measured: bool = True
    warned: bool = False

    def mfu(self, tokens_per_s: float, flops_per_token: float) -> Optional[float]:
        """`model_flops_utilization` against this peak, unclamped. The first MFU above 1
        logs one warning naming the FLOPs per token and the peak: against a datasheet
        peak that is a counting error (the model's FLOPs are overstated), against a
        timed one the matmul understated the GPU.

        Args:
          tokens_per_s: the training tokens per second the mesh reached.
          flops_per_token: `flops_per_token` of the model and sequence.
        """
        mfu = model_flops_utilization(tokens_per_s, flops_per_token, self.flops)
        if mfu is not None and mfu > 1 and not self.warned:
            self.warned = True
            cause = ("the timed matmul understates this GPU, or the FLOP count is wrong"
                     if self.measured else "a counting error: the model FLOPs per token "
                     "overstate what the step computes")
            log.warning("tfllm: MFU %.1f%% is above 100%%: %s (%s FLOPs/token x %.1f "
                        "tokens/s against a peak of %.4g FLOP/s, %s)", 100 * mfu, cause,
                        f"{flops_per_token:,.0f}", tokens_per_s, self.flops, self.source)
        return mfu


def gpu_name(device: str) -> str:
    """TensorFlow's name of the physical GPU behind a logical device string ('' if none)."""
    index = int(device.rsplit(":", 1)[-1])
    gpus = tf.config.list_physical_devices("GPU")
    if index >= len(gpus):
        return ""
    return tf.config.experimental.get_device_details(gpus[index]).get("device_name", "")


def mesh_peak(parallel, precision_policy: str, tf32: bool = True, measure=None,
              device_name=None) -> Peak:
    """The whole mesh's matmul peak.

    On GPUs whose name `datasheet_peak` knows, the datasheet's dense peak per GPU times
    the mesh's GPUs; on other GPUs a matmul timed on one local device
    (`measure_matmul_peak`) times the mesh's GPUs. On CPU none (`Peak.flops` None, the
    source `NO_CPU_PEAK`): a CPU has no datasheet figure tfllm can read reliably, and a
    timed one swung 2x with the host's other work, which would make MFU say more about
    the neighbours than about the step.

    Args:
      parallel: the run's `tfllm.parallel.Parallel`.
      precision_policy: the config's precision.policy.
      tf32: the config's precision.tf32.
      measure: the measurement (default `measure_matmul_peak`).
      device_name: the GPU's name (default: read from TensorFlow).
    """
    if parallel.device_type == "CPU":
        return Peak(None, NO_CPU_PEAK, measured=False)
    measure = measure or measure_matmul_peak
    devices = math.prod(parallel.shape.values())
    first = parallel.mesh.local_devices()[0]
    name = gpu_name(first) if device_name is None else device_name
    known = datasheet_peak(name, precision_policy, tf32)
    if known:
        return Peak(known[0] * devices, f"{known[1]}, x{devices} GPUs", measured=False)
    dtype = peak_dtype(precision_policy)
    n, repeats = 4096, 10
    with tf.device(first):
        peak = measure(n=n, repeats=repeats, dtype=dtype)
    return Peak(peak * devices, f"measured: {n}^3 {dtype.name} matmuls on one GPU, "
                f"x{devices}")


def model_flops_utilization(tokens_per_s: float, flops_per_token: float,
                            peak_flops: Optional[float]) -> Optional[float]:
    """MFU: achieved training FLOP/s over the peak, unclamped; None without a peak, 0
    before any step was timed. (`Peak.mfu` also warns when it passes 1.)"""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_token / peak_flops if tokens_per_s else 0.0


class Throughput:
    """Tokens per second of the steps of the current logging interval.

    Only the time spent in steps (reading the batch included) counts: evaluation,
    checkpoint saves and logging between steps do not, and the interval restarts at every
    logged step, so a figure describes the recent steps, not the run's average.
    """

    def __init__(self):
        self.seconds, self.tokens, self.last = 0.0, 0, 0.0

    def add_step(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def rate(self) -> float:
        """The current interval's tokens/s, else the last closed interval's."""
        return self.tokens / self.seconds if self.tokens and self.seconds else self.last

    def close_interval(self) -> float:
        """Ends the interval (at a logged step); returns its tokens/s."""
        self.last = self.rate()
        self.seconds, self.tokens = 0.0, 0
        return self.last
