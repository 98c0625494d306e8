"""Tiny keras-hub models with random weights, saved as presets or Hugging Face folders."""

import keras
import keras_hub
import numpy as np

from tfllm.pretrained.demo import SPECIAL_TOKENS, bpe_vocabulary

# Small enough to build in a second, shaped to divide over model=4 (8 query heads,
# 4 key-value heads, vocab 288, MLP 64).
VOCAB = 288  # the 256 bytes, specials and merges; divisible by model=4

_LLAMA = dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=8, hidden_dim=32,
              intermediate_dim=64, num_key_value_heads=4)

# float32 on both sides; the only differences are summation orders (einsum vs keras-hub's
# EinsumDense, softmax, RMSNorm) over widths <= 64 with random weights of std 0.3: the
# measured worst case is ~4e-7 of logits of magnitude ~2 (~7e-7 for the mixtures of
# experts), so 2e-5 leaves 30x headroom and still catches any wrong tensor, transposition,
# RoPE frequency or expert (errors of order 0.1-1).
ATOL = 2e-5

#: name -> (backbone class, constructor arguments); one per supported family/variant
BACKBONES = {
    "gpt2": (keras_hub.models.GPT2Backbone,
             dict(vocabulary_size=VOCAB, num_layers=2, num_heads=8, hidden_dim=32,
                  intermediate_dim=128, max_sequence_length=48)),  # HF GPT-2: 4 x hidden
    "llama2": (keras_hub.models.LlamaBackbone,
               dict(_LLAMA, layer_norm_epsilon=1e-5)),
    # Llama 3.1-style: llama3 RoPE scaling; the test sequences (40) pass the pre-training
    # length (16) so that every frequency band of the scaling is exercised.
    "llama3": (keras_hub.models.Llama3Backbone,
               dict(_LLAMA, rope_max_wavelength=500000, rope_frequency_adjustment_factor=8.0,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_pretraining_sequence_length=16)),
    "llama3_tied": (keras_hub.models.Llama3Backbone, dict(_LLAMA, tie_word_embeddings=True)),
    "mistral": (keras_hub.models.MistralBackbone, dict(_LLAMA, sliding_window=64)),
    # linear RoPE scaling (positions / 2), as Qwen2's and Mistral's RotaryEmbedding apply it
    "qwen": (keras_hub.models.QwenBackbone, dict(_LLAMA, tie_word_embeddings=False,
                                                 rope_scaling_factor=2.0)),
    # query/key norms, head_dim apart from hidden / heads, tied
    "qwen3": (keras_hub.models.Qwen3Backbone, dict(_LLAMA, head_dim=8,
                                                   tie_word_embeddings=True)),
    # Gemma 3: 6 layers so that keras-hub's fixed pattern has its global layer (5); a
    # window of 4 < 40 tokens; head_dim apart from hidden / heads; linear RoPE scaling
    # on the global layer
    "gemma3": (keras_hub.models.Gemma3Backbone, dict(
        vocabulary_size=VOCAB, image_size=None, num_layers=6, num_query_heads=8,
        num_key_value_heads=4, hidden_dim=32, intermediate_dim=64, head_dim=8,
        use_post_ffw_norm=True, use_post_attention_norm=True,
        use_sliding_window_attention=True, sliding_window_size=4,
        global_rope_scaling_factor=2.0, layer_norm_epsilon=1e-6)),
    # mixtures of experts, 4 experts (they split over model=4), top 2: Qwen3-MoE with a
    # dense layer between sparse ones (mlp_only_layers) and renormalized top-k weights;
    # Mixtral with a window (64) longer than the test sequences (40)
    "qwen3_moe": (keras_hub.models.Qwen3MoeBackbone, dict(
        _LLAMA, num_layers=3, head_dim=8, moe_intermediate_dim=16, num_experts=4, top_k=2,
        norm_top_k_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)),
    "mixtral": (keras_hub.models.MixtralBackbone, dict(
        _LLAMA, num_experts=4, top_k=2, sliding_window=64, layer_norm_epsilon=1e-5)),
}

#: the mixtures of experts of BACKBONES
MOE = ("mixtral", "qwen3_moe")

def random_weights(backbone, seed=0):
    """Replaces every weight by N(0, 0.3^2): the logits then depend on every tensor."""
    rng = np.random.RandomState(seed)
    for v in backbone.weights:
        if "seed_generator" not in v.path:
            v.assign(rng.normal(0, 0.3, v.shape).astype(v.dtype))


def make_backbone(name, seed=0, dtype="float32"):
    cls, kwargs = BACKBONES[name]
    keras.utils.set_random_seed(seed)
    backbone = cls(**kwargs, dtype=dtype)
    random_weights(backbone, seed)
    return backbone


def make_causal_lm(name, seed=0, dtype="float32"):
    """A keras-hub CausalLM with random weights and, for gpt2/llama3, a BPE tokenizer (for
    gemma3 a SentencePiece one)."""
    backbone = make_backbone(name, seed, dtype)
    base = type(backbone).__name__.replace("Backbone", "")
    task_cls = getattr(keras_hub.models, base + "CausalLM")
    key = "gpt2" if name == "gpt2" else "llama3"
    if name.startswith("llama3") or name == "gpt2":
        vocab, merges = bpe_vocabulary(SPECIAL_TOKENS[key], VOCAB)
        tokenizer = getattr(keras_hub.models, base + "Tokenizer")(vocabulary=vocab,
                                                                  merges=merges)
        pre = getattr(keras_hub.models, base + "CausalLMPreprocessor")(tokenizer=tokenizer)
        return task_cls(backbone=backbone, preprocessor=pre)
    if name == "gemma3":  # Gemma's SentencePiece layout (see transformers_reference)
        from tests.pretrained.transformers_reference import keras_hub_tokenizer
        pre = keras_hub.models.Gemma3CausalLMPreprocessor(
            tokenizer=keras_hub_tokenizer("gemma"), image_converter=None)
        return task_cls(backbone=backbone, preprocessor=pre)
    return task_cls(backbone=backbone, preprocessor=None)


def save_preset(name, path, seed=0, dtype="float32"):
    """A keras-hub preset directory (backbone, and task + tokenizer when there is one)."""
    lm = make_causal_lm(name, seed, dtype)
    if lm.preprocessor is None:
        lm.backbone.save_to_preset(str(path))
    else:
        lm.save_to_preset(str(path))
    return lm


def save_huggingface(name, path, seed=0):
    """A Hugging Face folder (config.json, model.safetensors, tokenizer) by keras-hub's
    own exporter."""
    lm = make_causal_lm(name, seed)
    lm.backbone.export_to_transformers(str(path)) if lm.preprocessor is None else \
        lm.export_to_transformers(str(path))
    return lm


def keras_hub_logits(lm, ids):
    """keras-hub's float32 logits (B, T, V) for token ids (B, T)."""
    mask = np.ones_like(ids)
    hidden = lm.backbone({"token_ids": ids, "padding_mask": mask})
    return np.asarray(lm.backbone.token_embedding(hidden, reverse=True), np.float32)


def token_ids(batch=2, length=40, vocab=VOCAB, seed=1):
    return np.random.RandomState(seed).randint(0, vocab, (batch, length)).astype("int32")
