"""The configuration schema: every tfllm setting and its default, in one place.

Each section is a typed dataclass. A field's `metadata` may carry `help`, `choices`,
`min` and `max`; `tfllm.config.loader` uses them to validate YAML files and
`--set section.key=value` overrides. Add a field here and nowhere else. Float fields
take finite numbers only: NaN and infinities are refused for every one (none of them
means "unlimited" by infinity; where a limit can be switched off, 0 does it).
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


#: Upper bounds of the size settings: far above any model or job of today (Llama 3.1
#: 405B: hidden 16384, intermediate 53248, 126 layers; Gemma 3: a 262144 vocabulary; 10M
#: token contexts), low enough that a typo or a crafted config (hidden_dim=10**20) is one
#: line at load time, not an allocation, a traceback or a segfault. The model's total size
#: is bounded by `tfllm.config.loader.validate` and, against the host, by the command.
_MAX_VOCAB = 2 ** 24
_MAX_WIDTH = 2 ** 20
_MAX_COUNT = 2 ** 12
_MAX_TOKENS = 2 ** 24


@dataclass
class ModelConfig:
    """Architecture of the causal language model."""

    family: str = _f("gpt", "Model family: gpt (learned positions, LayerNorm, GELU, tied "
                     "embeddings), llama (RoPE, RMSNorm, SwiGLU, GQA) or gemma3 (as llama "
                     "with embeddings scaled by sqrt(hidden_dim), zero-centred RMSNorm "
                     "scales (1 + scale), norms before and after attention and MLP, a tanh "
                     "GELU-gated MLP, query/key norms, tied embeddings).",
                     choices=("gpt", "llama", "gemma3"))
    vocab_size: int = _f(2048, "Vocabulary size.", min=2, max=_MAX_VOCAB)
    hidden_dim: int = _f(128, "Width of the residual stream.", min=1, max=_MAX_WIDTH)
    num_layers: int = _f(4, "Number of transformer blocks.", min=1, max=_MAX_COUNT)
    num_query_heads: int = _f(4, "Attention query heads.", min=1, max=_MAX_COUNT)
    num_key_value_heads: int = _f(0, "Key/value heads for grouped-query attention; 0 means "
                                  "equal to num_query_heads.", min=0, max=_MAX_COUNT)
    head_dim: int = _f(0, "Per-head width; 0 means hidden_dim // num_query_heads.",
                       min=0, max=_MAX_COUNT)
    intermediate_dim: int = _f(512, "Width of the MLP hidden layer.", min=1, max=_MAX_WIDTH)
    max_sequence_length: int = _f(256, "Longest sequence the model accepts.",
                                  min=1, max=_MAX_TOKENS)
    tie_embeddings: Optional[bool] = _f(None, "Share the token embedding with the LM head; "
                                        "null means the family's default (gpt: true, llama: "
                                        "false).")
    use_bias: Optional[bool] = _f(None, "Biases in dense layers; null means the family's "
                                  "default (gpt: true, llama: false).")
    norm_epsilon: float = _f(1e-5, "Epsilon of LayerNorm / RMSNorm.", min=0.0)
    rope_theta: float = _f(10000.0, "RoPE base frequency (llama).", min=1.0)
    rope_scaling: str = _f("none", "RoPE frequency scaling for long contexts (llama): none; "
                           "linear (positions divided by rope_scaling_factor, as Llama 2 "
                           "long-context models); llama3 (Llama 3.1+: low frequencies divided "
                           "by rope_scaling_factor, a smooth blend between "
                           "rope_low_freq_factor and rope_high_freq_factor).",
                           choices=("none", "linear", "llama3"))
    rope_scaling_factor: float = _f(1.0, "RoPE scaling factor (linear and llama3).", min=1.0)
    rope_low_freq_factor: float = _f(1.0, "llama3 RoPE scaling: wavelengths above "
                                     "rope_original_max_length / this are fully scaled.",
                                     min=0.0)
    rope_high_freq_factor: float = _f(4.0, "llama3 RoPE scaling: wavelengths below "
                                      "rope_original_max_length / this are unchanged.",
                                      min=0.0)
    rope_original_max_length: int = _f(8192, "llama3 RoPE scaling: the context length of "
                                       "pre-training.", min=1, max=_MAX_TOKENS)
    qkv_bias: Optional[bool] = _f(None, "Biases on the query/key/value projections only "
                                  "(Qwen2); null means use_bias.")
    qk_norm: bool = _f(False, "RMSNorm (epsilon norm_epsilon, a scale per head_dim channel) "
                       "over each head's queries and keys before RoPE (Qwen3, llama; gemma3 "
                       "always has them).")
    sliding_window: int = _f(0, "Local attention: a query sees only the last N keys, itself "
                             "included (transformers' sliding_window); 0 means every layer "
                             "attends to the whole context (rope families).",
                             min=0, max=_MAX_TOKENS)
    sliding_window_pattern: int = _f(0, "With sliding_window: every Nth layer (N-1, 2N-1, "
                                     "...) attends globally and the others locally (Gemma 3: "
                                     "6); 0 means every layer is local.", min=0, max=_MAX_COUNT)
    rope_local_theta: float = _f(0.0, "RoPE base of the local (sliding-window) layers, which "
                                 "rope_scaling never scales (Gemma 3: 10000); 0 means "
                                 "rope_theta.", min=0.0)
    query_pre_attn_scalar: float = _f(0.0, "Attention scores are divided by the square root "
                                      "of this (Gemma 3's query_pre_attn_scalar); 0 means "
                                      "head_dim.", min=0.0)
    attention: str = _f("xla", "Which attention kernel: xla (the attention written in "
                        "TensorFlow ops, standard or blocked by attention_chunk, compiled by "
                        "XLA on every device) or cudnn (cuDNN's fused flash attention), "
                        "which TensorFlow 2.21's DTensor cannot run inside a step: refused, "
                        "see docs/design.md's 'Fused (cuDNN) attention on a DTensor mesh'.",
                        choices=("xla", "cudnn"))
    attention_chunk: int = _f(0, "Blocked (flash) attention: when > 0 and the sequence is "
                              "longer, attention runs over blocks of this many queries, each "
                              "attending the keys it may see as tiles of up to 4096 keys "
                              "(an online softmax between tiles), recomputed in the backward "
                              "pass, so no (T x T) scores are ever kept (memory linear in T) "
                              "and key blocks the causal mask hides are skipped; 0 is "
                              "standard attention. Same result up to float rounding.",
                              min=0, max=_MAX_TOKENS)
    remat: str = _f("none", "Activation rematerialization (tfllm.models.common.remat): none; "
                    "full (keep each block's input, recompute the block); selective (keep "
                    "matmul outputs, recompute norms, activations and attention scores); "
                    "attention (recompute only the attention scores and softmax).",
                    choices=("none", "full", "selective", "attention"))
    init_std: float = _f(0.02, "Standard deviation of the normal weight init; residual "
                         "output projections use init_std / sqrt(2 * num_layers).", min=0.0)
    num_experts: int = _f(0, "Mixture of experts (llama family; Qwen3-MoE, Mixtral): the "
                          "experts of each sparse layer's MLP (see decoder_sparse_step and "
                          "mlp_only_layers); 0 means every MLP is dense.", min=0, max=_MAX_COUNT)
    num_experts_per_tok: int = _f(2, "Mixture of experts: the experts each token is routed to "
                                  "(k of num_experts).", min=1, max=_MAX_COUNT)
    moe_intermediate_dim: int = _f(0, "Mixture of experts: each expert's MLP width "
                                   "(transformers' moe_intermediate_size); 0 means "
                                   "intermediate_dim.", min=0, max=_MAX_WIDTH)
    moe_routing: str = _f("softmax_then_topk", "Mixture of experts: softmax_then_topk (the "
                          "softmax over all experts, then the k largest: Qwen3-MoE) or "
                          "topk_then_softmax (the softmax over the k largest logits: Mixtral).",
                          choices=("softmax_then_topk", "topk_then_softmax"))
    norm_topk_prob: bool = _f(True, "Mixture of experts, softmax_then_topk: renormalize the k "
                              "routing weights to sum to one (Qwen3-MoE's norm_topk_prob).")
    router_aux_loss_coef: float = _f(0.001, "Mixture of experts: the training loss adds this "
                                     "times Switch's load-balancing loss over all sparse "
                                     "layers (transformers' router_aux_loss_coef, as with "
                                     "output_router_logits); 0: none.", min=0.0)
    router_z_loss_coef: float = _f(0.0, "Mixture of experts: the training loss adds this times "
                                   "ST-MoE's router z-loss (mean squared logsumexp of the "
                                   "router logits; ST-MoE uses 0.001); 0: none.", min=0.0)
    decoder_sparse_step: int = _f(1, "Mixture of experts: layer i is sparse when (i + 1) is a "
                                  "multiple of this and i is not in mlp_only_layers "
                                  "(Qwen3-MoE's rule; 1: every layer).", min=1,
                                  max=_MAX_COUNT)
    mlp_only_layers: List[int] = _f([], "Mixture of experts: layers whose MLP stays dense "
                                    "(Qwen3-MoE's mlp_only_layers).")
    moe_dispatch: str = _f("slots", "Mixture of experts: how tokens reach their experts "
                           "(tfllm.models.common.dispatch): slots (a buffer of slots per "
                           "expert and sequence, batched einsums: dropless costs num_experts "
                           "/ k times the active FLOPs; the only dispatch with "
                           "moe_capacity_factor) or grouped (tokens sorted into expert tiles "
                           "for a grouped matmul: the active FLOPs plus tile padding; "
                           "dropless).", choices=("slots", "grouped"))
    moe_capacity_factor: float = _f(0.0, "Mixture of experts, slots dispatch: each expert takes "
                                    "at most ceil(factor * T * k / num_experts) tokens of a "
                                    "sequence and drops the rest (GShard, Switch); 0 means "
                                    "dropless (no token is dropped).", min=0.0)


@dataclass
class MeshConfig:
    """The device mesh and the sharding-rules table."""

    axes: str = _f("data=-1", "Mesh axes as name=size pairs, e.g. 'data=2,fsdp=2,model=2'; "
                   "one size may be -1 to use the remaining devices. Names: data, fsdp, model.")
    device_type: str = _f("auto", "auto (GPU when present, else CPU), CPU or GPU.",
                          choices=("auto", "CPU", "GPU"))
    num_cpu_devices: int = _f(0, "Logical CPU devices to split the host into; 0 means as "
                              "many as the mesh needs (at most tfllm.runtime.devices."
                              "MAX_CPU_DEVICES).", min=0)
    rules: List[List[str]] = _f([], "Ordered [logical_axis, mesh_axis] pairs that replace "
                                "the default rules table (tfllm.parallel.rules."
                                "DEFAULT_RULES); mesh_axis 'null' means replicated.")
    gpu_memory_reserve_mb: int = _f(4096, "GPU memory (MiB) TensorFlow leaves outside its "
                                    "allocator's pool for NCCL's buffers (NVLS on HGX H100) "
                                    "and CUDA library workspaces, which allocate outside it "
                                    "(sets TF_DEVICE_MIN_SYS_MEMORY_IN_MB unless it is set).",
                                    min=0, max=_MAX_WIDTH)
    gpu_allocator: str = _f("bfc", "TensorFlow's GPU allocator: bfc (its default: one pool "
                            "taken at start-up) or cuda_malloc_async (CUDA's stream-ordered "
                            "allocator, which gives freed memory back so NCCL can use it; "
                            "sets TF_GPU_ALLOCATOR unless it is set).",
                            choices=("bfc", "cuda_malloc_async"))
    gradient_bucket_mb: float = _f(25.0, "Largest float32 buffer of replicated (data-"
                                   "parallel) gradients all-reduced in one collective "
                                   "(MiB): each block's are reduced together, split into "
                                   "buckets of at most this size (PyTorch DDP's default "
                                   "bucket_cap_mb is 25); a block's FSDP shards are "
                                   "reduce-scattered in one buffer whatever the size.",
                                   min=0.001)


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
    fp8_gather: bool = _f(True, "Under FSDP, FP8 projections gather their weights as E4M3 "
                          "bytes (two per 16-bit carrier), half the bytes of a bfloat16 "
                          "gather, with the same values. false: gather in bfloat16 and "
                          "quantize after (for comparison).")
    tf32: bool = _f(True, "float32 matmuls on Ampere, Hopper and Blackwell GPUs run on the "
                    "TF32 tensor cores (10-bit mantissa; TensorFlow's default; the plan's "
                    "float32 peak). false: IEEE float32 GEMMs (XLA dots at HIGHEST "
                    "precision), many times slower. No effect on CPU, nor on bf16, fp16 "
                    "and fp8 matmuls.")
    loss_scale_initial: float = _f(32768.0, "float16: initial dynamic loss scale.", min=1.0)
    loss_scale_growth_interval: int = _f(2000, "float16: double the loss scale after this "
                                         "many finite steps in a row.", min=1)


@dataclass
class OptimizerConfig:
    """AdamW, its schedule and gradient clipping."""

    learning_rate: float = _f(3e-3, "Peak learning rate.", min=0.0)
    warmup_steps: int = _f(50, "Linear warmup steps from 0 to the peak.", min=0)
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
    """Where token batches come from and how they are tokenized and packed."""

    source: str = _f("corpus", "Token source: corpus (the embedded default: text from this "
                     "Python's standard library, built offline), text (plain UTF-8 files "
                     "from data.paths), tfrecord (tf.train.Example files from data.paths, "
                     "string feature data.text_key), tfds (a TensorFlow Datasets name), hf "
                     "(Hugging Face datasets: parquet, JSON, CSV or arrow files of "
                     "data.paths, or data.hf_dataset; pip install 'tfllm[hf-data]') or "
                     "synthetic (deterministic learnable token sequences, no tokenizer).",
                     choices=("corpus", "text", "tfrecord", "tfds", "hf", "synthetic"))
    paths: List[str] = _f([], "text/tfrecord/hf: file paths or glob patterns of the training "
                          "data.")
    eval_paths: List[str] = _f([], "text/tfrecord/hf: files or globs of the validation data; "
                               "empty means hold out data.validation_fraction of the "
                               "documents of data.paths.")
    format: str = _f("text", "What one record of the data is: text (a document of plain "
                     "text), messages (a JSONL line {\"messages\": [{\"role\", \"content\"}, "
                     "...]}: a conversation of system, user, assistant and tool turns, "
                     "rendered by the model's chat template), prompt_completion (a JSONL "
                     "line {\"prompt\", \"completion\"}) or preference (a JSONL line "
                     "{\"prompt\", \"chosen\", \"rejected\"} in TRL's layouts, strings or "
                     "conversations, for train.objective=dpo: tfllm/data/preference.py). "
                     "messages, prompt_completion and preference read data.paths / "
                     "data.eval_paths as JSONL files (source text), or the same columns of "
                     "a Hugging Face dataset (source hf).",
                     choices=("text", "messages", "prompt_completion", "preference"))
    chat_template: str = _f("", "messages: a Jinja chat template file (.jinja) to render "
                            "conversations; empty: the tokenizer's own "
                            "(chat_template.jinja, else tokenizer_config.json's "
                            "chat_template, in data.tokenizer_path).")
    text_key: str = _f("text", "tfrecord/tfds/hf: the feature (hf: the column) holding each "
                       "document's text.")
    hf_dataset: str = _f("", "hf without data.paths: a folder save_to_disk wrote, or a hub "
                         "dataset (user/name: from the Hugging Face cache, downloaded where "
                         "the machine can; HF_HUB_OFFLINE=1 keeps to the cache).")
    hf_config: str = _f("", "hf: the hub dataset's configuration (load_dataset's name).")
    hf_split: str = _f("train", "hf: the split of data.hf_dataset used for training.")
    hf_eval_split: str = _f("", "hf: the split of data.hf_dataset used for validation; "
                            "empty: hold out data.validation_fraction of data.hf_split.")
    hf_streaming: bool = _f(False, "hf: read rows as they are used (an IterableDataset: "
                            "nothing is converted into the arrow cache first), for sets "
                            "larger than the disk; the same batches as without, each row "
                            "stream reading the whole set.")
    tfds_name: str = _f("", "tfds: dataset name, e.g. 'wikipedia/20230601.en' or "
                        "'lm1b'.")
    tfds_split: str = _f("train", "tfds: split used for training.")
    tfds_eval_split: str = _f("validation", "tfds: split used for validation.")
    tfds_data_dir: str = _f("", "tfds: data_dir holding prepared datasets (empty: TFDS's "
                            "default).")
    data_dir: str = _f("~/.cache/tfllm", "Where the embedded corpus and trained "
                       "tokenizers are cached.")
    validation_fraction: float = _f(0.02, "Fraction of documents held out for validation "
                                    "when no separate validation data is named (chosen by "
                                    "a hash of each document, so the split never overlaps). "
                                    "0 without data.eval_paths / data.tfds_eval_split: no "
                                    "validation data and no evaluation (as Keras' "
                                    "validation_split=0).", min=0.0, max=0.5)
    tokenizer: str = _f("sentencepiece", "sentencepiece (a unigram SentencePiece model "
                        "trained offline on the training data at model.vocab_size and saved "
                        "in the workdir), byte (UTF-8 bytes plus an end-of-document id; "
                        "needs model.vocab_size >= 257) or file (data.tokenizer_path).",
                        choices=("sentencepiece", "byte", "file"))
    tokenizer_path: str = _f("", "tokenizer=file: a SentencePiece .model file or a "
                             "keras-hub tokenizer preset directory.")
    packing_mask: bool = _f(True, "Documents packed into one sequence do not attend to "
                            "each other.")
    shuffle_buffer: int = _f(256, "Documents in the shuffle buffers of all rows together "
                             "(each row stream gets an equal share; the buffers are part of "
                             "every checkpoint).", min=1, max=_MAX_TOKENS)
    sequence_length: int = _f(128, "Tokens per training sequence.", min=2, max=_MAX_TOKENS)
    seed: int = _f(1234, "Seed of the data order.")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = _f(1200, "Optimizer steps to run.", min=1)
    global_batch_size: int = _f(16, "Sequences per optimizer step, over all devices and "
                                "micro-batches (preference pairs with train.objective=dpo: "
                                "each pair is two sequences, chosen and rejected).",
                                min=1, max=_MAX_TOKENS)
    objective: str = _f("sft", "What the step minimizes: sft (next-token cross-entropy on "
                        "the tokens of train.loss_on) or dpo (direct preference "
                        "optimization on data.format=preference pairs, the loss of "
                        "dpo.loss; the reference is the model with its LoRA adapters off, "
                        "or without LoRA a frozen copy of the initial weights, laid out as "
                        "the model and saved with the run).", choices=("sft", "dpo"))
    grad_accum_steps: int = _f(1, "Micro-batches accumulated per optimizer step.",
                               min=1, max=_MAX_TOKENS)
    loss_on: str = _f("all", "Which target tokens the loss trains on: all; completion "
                      "(prompt_completion data: the completion only); assistant (messages "
                      "data: every assistant turn, its end-of-turn token included); "
                      "last_assistant (the last assistant turn of each conversation).",
                      choices=("all", "completion", "assistant", "last_assistant"))
    memory_check: bool = _f(True, "On GPUs, before the run starts (and in tfllm doctor "
                            "--config), estimate one device's memory from the shapes "
                            "(tfllm.footprint.fit) and stop with one line naming the --set that "
                            "fits when it will not; false skips it (the estimate errs high, "
                            "by up to 1.5x against XLA's compiled H100 programs).")
    seed: int = _f(0, "Seed of the weight initialization.")
    jit_compile: str = _f("auto", "XLA-compile the train step, evaluation and generation: "
                          "true (stops with an error if XLA compiles nothing), false, or "
                          "auto (XLA on GPU, graphs on CPU where XLA measured slower; see "
                          "benchmarks/results/cpu_jit.md).",
                          choices=("auto", "true", "false"))
    profile_steps: str = _f("", "Trace these steps with TensorFlow's profiler, e.g. 5-7 "
                            "(first-last, inclusive) or 5: an op and XLA-cluster timeline "
                            "per device, with memory, in WORKDIR/tensorboard/plugins/profile "
                            "(TensorBoard's Profile tab, or tfllm.train.profile.summary). "
                            "Empty: no trace. Leave out the first step: it compiles.")
    xla_cache: str = _f("auto", "Persistent cache of compiled XLA programs and GPU "
                        "autotuning, so a restart does not compile again: auto (WORKDIR/"
                        "xla_cache/client_N), off, or a directory.")
    log_every: int = _f(50, "Write metrics every N steps.", min=1)
    eval_every: int = _f(300, "Evaluate on the validation data every N steps (0: only at "
                         "the end, after the final checkpoint). Without validation data "
                         "(data.validation_fraction) nothing is evaluated.", min=0)
    eval_steps: int = _f(16, "Validation batches per evaluation (at most: validation data "
                         "shorter than this is padded, and padding is not counted).",
                         min=1, max=_MAX_TOKENS)
    deterministic: bool = _f(False, "Deterministic ops (tf.config.experimental."
                             "enable_op_determinism) for bitwise-reproducible resumes.")
    progress: str = _f("auto", "Progress display: bar (redrawn line), lines (one line per "
                       "log step), none, or auto (bar on a terminal, else lines).",
                       choices=("auto", "bar", "lines", "none"))
    on_nonfinite: str = _f("abort", "A NaN/Inf loss or gradient norm: abort (exit non-zero; "
                           "the last good checkpoint stays the latest) or skip (the update "
                           "is skipped on every client and counted).",
                           choices=("abort", "skip"))
    loss_spike_factor: float = _f(0.0, "Skip a step whose loss exceeds this factor times the "
                                  "mean of the last loss_spike_window losses (0: off).",
                                  min=0.0)
    loss_spike_window: int = _f(20, "Losses averaged by the loss-spike guard.", min=1)
    sample_prompt: str = _f("def ", "Prompt of the sample printed at the end of training "
                            "(data.format=messages: a user message, answered through the "
                            "chat template).")
    sample_tokens: int = _f(48, "Tokens generated for the end-of-training sample (0: none).",
                            min=0)
    peer_timeout_s: float = _f(300.0, "Multi-client runs: a client whose heartbeat is silent "
                               "this long is lost; the others exit 76 with one line naming "
                               "it (0: never; keep it above the longest pause, e.g. a "
                               "compile, of a live client).", min=0.0)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of the whole run state."""

    every: int = _f(300, "Save every N steps (0: only at the end).", min=0)
    max_to_keep: int = _f(3, "Committed checkpoints kept; older ones are deleted.", min=1)
    async_save: bool = _f(False, "Write shards in a background thread while training "
                          "continues; errors surface at the next save or at exit.")
    on_corruption: str = _f("error", "A checkpoint that fails its checksums: error, or "
                            "fallback to the previous committed checkpoint with a warning.",
                            choices=("error", "fallback"))


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA): y = x W + s (x A) B with W frozen, A and B trained."""

    rank: int = _f(0, "Rank r of every adapter; 0: no adapters (every weight trains). At "
                   "most model.hidden_dim: no adapter's update A B has a higher rank.",
                   min=0, max=_MAX_WIDTH)
    alpha: float = _f(16.0, "Scale numerator: s = alpha / rank (alpha / sqrt(rank) with "
                      "rslora).", min=0.0)
    dropout: float = _f(0.0, "Dropout on each adapter's input x in training (peft's "
                        "lora_dropout; a mask drawn per step, micro-batch and projection, "
                        "the same in a recomputed forward pass).", min=0.0, max=0.9)
    rslora: bool = _f(False, "Rank-stabilized LoRA: s = alpha / sqrt(rank).")
    targets: List[str] = _f([], "Projections that get adapters, in Hugging Face module "
                            "names as peft's target_modules (a name matches a module path "
                            "or its end): llama, mistral, qwen2/3, gemma3: q_proj k_proj "
                            "v_proj o_proj gate_proj up_proj down_proj; gpt: attn.c_attn "
                            "attn.c_proj mlp.c_fc mlp.c_proj; mixtures of experts also "
                            "experts.gate_up_proj experts.down_proj (peft's "
                            "target_parameters: per expert, gate and up sharing one A; the "
                            "MLP names then mean the dense layers'). Empty: every attention "
                            "and MLP projection each layer has. "
                            "A name that matches no projection of the family is an error.")


@dataclass
class DpoConfig:
    """Direct preference optimization (train.objective=dpo), computed as TRL's DPOTrainer.

    Sequence log-probabilities are summed over each completion's tokens; delta = (log
    pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)); the loss is the mean
    over pairs (tfllm/train/dpo.py)."""

    loss: str = _f("sigmoid", "sigmoid: -log sigmoid(beta delta) (DPO; with label_smoothing "
                   "e: -(1 - e) log sigmoid(beta delta) - e log sigmoid(-beta delta), "
                   "conservative DPO); hinge: max(0, 1 - beta delta) (SLiC); ipo: (delta' - "
                   "1 / (2 beta))^2 with each log-ratio divided by its completion's token "
                   "count (IPO, as TRL normalizes it); orpo: reference-free, the chosen "
                   "sequences' NLL minus beta log sigmoid of the log odds ratio of the mean "
                   "token log-probabilities (ORPO, as TRL's ORPOTrainer; beta is its "
                   "lambda).",
                   choices=("sigmoid", "hinge", "ipo", "orpo"))
    beta: float = _f(0.1, "Temperature beta: how far the policy may move from the "
                     "reference (IPO: the regularization tau). Rewards are beta times the "
                     "log-ratios.", min=1e-6, max=1e6)
    label_smoothing: float = _f(0.0, "sigmoid only: the probability e that a pair's "
                                "preference is flipped (conservative DPO); 0: plain DPO.",
                                min=0.0, max=0.49)
    rpo_alpha: float = _f(0.0, "Adds rpo_alpha times the chosen completions' mean "
                          "next-token NLL (over their tokens in the micro-batch) to the loss "
                          "(RPO; TRL's loss_type [..., \"sft\"] with that weight); 0: none.",
                          min=0.0, max=1e6)
    precompute_reference: bool = _f(
        False, "Compute the reference's log-probabilities (each pair's chosen and rejected "
        "sums) once, in one forward pass over the training and held-out pairs before the "
        "first step, and store them with the run (WORKDIR/reference_logps.json; a resume "
        "reads them back and refuses data that changed); the step then runs no reference "
        "forward pass, and full fine-tuning (lora.rank=0) keeps no frozen copy of the "
        "weights (TRL's precompute_ref_log_probs). Not with dpo.loss=orpo (no reference).")


@dataclass
class TrackingConfig:
    """Experiment trackers (MLflow, W&B) beside metrics.jsonl and TensorBoard."""

    loggers: List[str] = _f([], "Experiment trackers that also get the run, from client 0: "
                            "mlflow, wandb (pip install 'tfllm[trackers]'). Each gets the "
                            "records of metrics.jsonl (always written, with TensorBoard), the "
                            "resolved config as parameters, and config.yaml, costs.json and "
                            "loss.png as artefacts; a resumed run continues its tracker run "
                            "(WORKDIR/trackers.json). A tracker that cannot start is one line "
                            "and exit 2 before step 1; one that fails later, a warning.",
                            choices=("mlflow", "wandb"))
    run_name: str = _f("", "The tracker run's name; empty: the workdir's folder name.")
    mlflow_uri: str = _f("", "MLflow tracking URI: a server (http://host:5000), a database "
                         "(sqlite:///mlflow.db) or a folder (file:./mlruns; MLflow 3 wants "
                         "MLFLOW_ALLOW_FILE_STORE=true for it). Empty: where a resumed run "
                         "started, else MLFLOW_TRACKING_URI, else MLflow's own default, a local "
                         "store in the current directory (sqlite:///mlflow.db in MLflow 3.17). "
                         "A relative path is made absolute as the run starts.")
    mlflow_experiment: str = _f("", "MLflow experiment of a new run; empty: "
                                "MLFLOW_EXPERIMENT_NAME, else tfllm.")
    wandb_project: str = _f("", "W&B project; empty: WANDB_PROJECT, else tfllm.")
    wandb_entity: str = _f("", "W&B entity (user or team); empty: WANDB_ENTITY, else the "
                           "login's default.")
    wandb_mode: str = _f("auto", "online; offline (no network: the run is kept in "
                         "WORKDIR/wandb, or WANDB_DIR, until wandb sync uploads it); auto: "
                         "WANDB_MODE when set, else online when logged in (wandb login, "
                         "WANDB_API_KEY), else offline with a note.",
                         choices=("auto", "online", "offline"))


@dataclass
class Config:
    """The whole configuration of a tfllm run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
