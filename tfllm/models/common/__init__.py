"""Layers shared by the model families; each names the logical axes of its weights."""
from tfllm.models.common.attention import (Attention, AttentionSettings, RopeScaling,
                                           rope_inverse_frequencies, rotary, write_cache)
from tfllm.models.common.layers import (LayerNorm, PositionEmbedding, Projection, RMSNorm,
                                        TokenEmbedding, add_param)
from tfllm.models.common.mlp import MLP, GatedMLP
from tfllm.models.common.masks import cache_mask_and_positions, segment_mask_and_positions
