"""The configuration schema: every tfllm setting and its default, in one place.

Each section is a typed dataclass. A field's `metadata` may carry `help`, `choices`,
`min` and `max`; `tfllm.config.loader` uses them to validate YAML files and
`--set section.key=value` overrides. Add a field here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional


def _f(default, help, **meta):
    """A dataclass field with validation metadata (help, choices, min, max)."""
    meta["help"] = help
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """Architecture of the causal language model."""

    family: str = _f("gpt", "Model family: gpt (learned positions, LayerNorm, GELU, tied "
                     "embeddings) or llama (RoPE, RMSNorm, SwiGLU, GQA).",
                     choices=("gpt", "llama"))
    vocab_size: int = _f(128, "Vocabulary size.", min=2)
    hidden_dim: int = _f(64, "Width of the residual stream.", min=1)
    num_layers: int = _f(2, "Number of transformer blocks.", min=1)
    num_query_heads: int = _f(4, "Attention query heads.", min=1)
    num_key_value_heads: int = _f(0, "Key/value heads for grouped-query attention; 0 means "
                                  "equal to num_query_heads.", min=0)
    head_dim: int = _f(0, "Per-head width; 0 means hidden_dim // num_query_heads.", min=0)
    intermediate_dim: int = _f(256, "Width of the MLP hidden layer.", min=1)
    max_sequence_length: int = _f(128, "Longest sequence the model accepts.", min=1)
    tie_embeddings: Optional[bool] = _f(None, "Share the token embedding with the LM head; "
                                        "null means the family's default (gpt: true, llama: "
                                        "false).")
    use_bias: Optional[bool] = _f(None, "Biases in dense layers; null means the family's "
                                  "default (gpt: true, llama: false).")
    norm_epsilon: float = _f(1e-5, "Epsilon of LayerNorm / RMSNorm.", min=0.0)
    rope_theta: float = _f(10000.0, "RoPE base frequency (llama).", min=1.0)
    init_std: float = _f(0.02, "Standard deviation of the normal weight init; residual "
                         "output projections use init_std / sqrt(2 * num_layers).", min=0.0)


@dataclass
class MeshConfig:
    """The device mesh and the sharding-rules table."""

    axes: str = _f("data=-1", "Mesh axes as name=size pairs, e.g. 'data=2,fsdp=2,model=2'; "
                   "one size may be -1 to use the remaining devices. Names: data, fsdp, model.")
    device_type: str = _f("auto", "auto (GPU when present, else CPU), CPU or GPU.",
                          choices=("auto", "CPU", "GPU"))
    num_cpu_devices: int = _f(0, "Logical CPU devices to split the host into; 0 means as "
                              "many as the mesh needs.", min=0)
    rules: List[List[str]] = _f([], "Ordered [logical_axis, mesh_axis] pairs that replace "
                                "the default rules table (tfllm.parallel.rules."
                                "DEFAULT_RULES); mesh_axis 'null' means replicated.")


@dataclass
class PrecisionConfig:
    """Numeric precision of compute and weights."""

    policy: str = _f("float32", "float32; bfloat16 (bf16 compute; fp32 weights, optimizer "
                     "states, softmax, norm statistics, logits and loss); float16 (the same "
                     "with fp16 compute and dynamic loss scaling); fp8 (bfloat16 plus FP8 "
                     "matmuls in the attention and MLP projections).",
                     choices=("float32", "bfloat16", "float16", "fp8"))
    fp8_recipe: str = _f("delayed", "FP8 scaling: current (amax of this step) or delayed "
                         "(largest amax of a history).", choices=("current", "delayed"))
    fp8_amax_history_length: int = _f(16, "Steps of amax history for delayed scaling.",
                                      min=1, max=1024)
    fp8_margin: int = _f(0, "FP8 scale = format max / (amax * 2**margin).", min=0, max=16)
    fp8_exclude: List[str] = _f([], "Layer-path substrings whose projections stay in bf16 "
                                "under fp8, e.g. ['block_0/', 'mlp/down']. The embedding, LM "
                                "head and norms are always bf16.")
    loss_scale_initial: float = _f(32768.0, "float16: initial dynamic loss scale.", min=1.0)
    loss_scale_growth_interval: int = _f(2000, "float16: double the loss scale after this "
                                         "many finite steps in a row.", min=1)


@dataclass
class OptimizerConfig:
    """AdamW, its schedule and gradient clipping."""

    learning_rate: float = _f(3e-3, "Peak learning rate.", min=0.0)
    warmup_steps: int = _f(10, "Linear warmup steps from 0 to the peak.", min=0)
    decay_steps: int = _f(0, "Steps of cosine decay after warmup; 0 means until "
                          "train.steps.", min=0)
    min_learning_rate_ratio: float = _f(0.1, "Final learning rate as a fraction of the peak.",
                                        min=0.0, max=1.0)
    beta1: float = _f(0.9, "Adam beta1.", min=0.0, max=1.0)
    beta2: float = _f(0.95, "Adam beta2.", min=0.0, max=1.0)
    epsilon: float = _f(1e-8, "Adam epsilon.", min=0.0)
    weight_decay: float = _f(0.1, "Decoupled weight decay.", min=0.0)
    weight_decay_exclude: List[str] = _f(["bias", "norm", "embedding"],
                                         "Variable kinds without weight decay: any of bias, "
                                         "norm, embedding.")
    clip_norm: float = _f(1.0, "Global gradient-norm clipping threshold; 0 disables.", min=0.0)
    shard_optimizer_state: bool = _f(False, "ZeRO-1: also shard each optimizer state over "
                                     "the data axis.")


@dataclass
class DataConfig:
    """Where token batches come from."""

    source: str = _f("synthetic", "Token source: synthetic (deterministic, learnable "
                     "sequences; no download).", choices=("synthetic",))
    sequence_length: int = _f(64, "Tokens per training sequence.", min=2)
    seed: int = _f(1234, "Seed of the data order.")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = _f(100, "Optimizer steps to run.", min=1)
    global_batch_size: int = _f(16, "Sequences per optimizer step, over all devices and "
                                "micro-batches.", min=1)
    grad_accum_steps: int = _f(1, "Micro-batches accumulated per optimizer step.", min=1)
    seed: int = _f(0, "Seed of the weight initialization.")
    jit_compile: str = _f("auto", "XLA-compile the train step: true, false or auto (XLA on "
                          "GPU and CPU; on CPU both measured equal, see "
                          "benchmarks/results/cpu_jit.md).",
                          choices=("auto", "true", "false"))
    log_every: int = _f(10, "Write metrics every N steps.", min=1)


@dataclass
class Config:
    """The whole configuration of a tfllm run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
