"""Every model family has every piece, and the pieces fit its model.

`tfllm.families` holds one module per Hugging Face model_type. A family added without
its config.json writer, its tensors, its keras-hub map, its LoRA names or a tiny section
here fails below: the tensors and maps are held to the variables the model code builds,
and keras-hub's own converter must build a backbone the family maps.
"""

import json

import pytest

from tfllm.config.schema import Config, ModelConfig
from tfllm.families import (BACKBONES, FAMILIES, PretrainedError, Sliced, default_backbone,
                            keras_hub_path, layer_kinds, lora_names, resolved, writer)
from tfllm.internals import preset_loader
from tfllm.models import FAMILIES as MODEL_CLASSES
from tfllm.models import build_model, model_class

_TINY = dict(vocab_size=64, hidden_dim=16, num_layers=3, num_query_heads=4,
             num_key_value_heads=2, intermediate_dim=24, max_sequence_length=32)

#: model_type -> (a tiny model section it writes, the keras-hub backbone it came from)
SECTIONS = {
    "gpt2": ({"family": "gpt", "num_key_value_heads": 0}, None),
    "llama": ({"family": "llama"}, None),
    "mistral": ({"family": "llama", "sliding_window": 8}, None),
    "qwen2": ({"family": "llama", "qkv_bias": True, "tie_embeddings": True}, None),
    "qwen3": ({"family": "llama", "qk_norm": True}, None),
    "gemma3_text": ({"family": "gemma3", "sliding_window": 8, "sliding_window_pattern": 2,
                     "rope_local_theta": 10000.0, "head_dim": 8, "qk_norm": True,
                     "query_pre_attn_scalar": 8.0}, None),
    # mixtures of experts: a dense layer between sparse ones (Qwen3-MoE), every layer
    # sparse (Mixtral); head_dim stated, as their config.json states it
    "qwen3_moe": ({"family": "llama", "qk_norm": True, "head_dim": 4, "num_experts": 4,
                   "moe_intermediate_dim": 8, "mlp_only_layers": [1]}, None),
    "mixtral": ({"family": "llama", "head_dim": 4, "num_experts": 4,
                 "moe_intermediate_dim": 24, "moe_routing": "topk_then_softmax"}, None),
}


def _section(model_type):
    fields, backbone = SECTIONS[model_type]
    return ModelConfig(**{**_TINY, **fields}), backbone


def _weights(m):
    """{tfllm variable path below the model's name: shape} of the model `m` describes."""
    config = Config()
    config.model = m
    model = build_model(config.model, config.precision, config.lora, allocate=False)
    prefix = model.name + "/"
    return {v.path[len(prefix):]: tuple(int(n) for n in v.shape) for v in model.variables
            if getattr(v, "kind", None) != "fp8_state"}


def test_every_family_has_a_tiny_section_here():
    assert set(SECTIONS) == set(FAMILIES), "add the new family's tiny section to SECTIONS"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_family_declares_every_piece(model_type):
    family = FAMILIES[model_type]
    assert family.model_type == model_type and family.architecture
    assert family.model_family in MODEL_CLASSES, "its model code: tfllm.models.FAMILIES"
    for piece in ("writes", "config_out", "tensors", "default_backbone", "layer_kinds"):
        assert callable(getattr(family, piece)), piece
    assert family.lora.modules and "{i}" in family.lora.layer_prefix
    # the keras-hub backbones it maps, or its own reader of config.json and tensors
    assert family.keras_hub or (family.config_in and family.tensors_in)
    for backbone in family.keras_hub:
        assert BACKBONES[backbone.name] is backbone
        assert backbone.model_family == family.model_family and backbone.understood
        for piece in ("model_fields", "backbone_kwargs", "weight_map"):
            assert callable(getattr(backbone, piece)), (backbone.name, piece)
    # families computed by the same model code name their LoRA modules alike (lora.targets
    # is read with the model family only)
    assert lora_names(family.model_family) == family.lora


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_familys_tensors_and_maps_are_the_models_weights(model_type):
    family = FAMILIES[model_type]
    m, backbone = _section(model_type)
    r = resolved(m, model_class(m.family).family_defaults)
    assert writer(r, backbone) is family
    weights = _weights(m)
    tensors = family.tensors(r)
    sources = [s for t in tensors for s in t.sources]
    # every weight is one Hugging Face tensor's, or (a stacked expert kernel) several's
    assert set(sources) == set(weights)
    assert len(sources) == len(weights) or m.num_experts
    assert len({t.key for t in tensors}) == len(tensors)
    config = family.config_out(r, {"vocab_size": m.vocab_size})
    assert config["model_type"] == model_type
    assert config["architectures"] == [family.architecture]
    for b in family.keras_hub:
        mapping = b.weight_map(m)
        assert sorted(mapping) == sorted(weights), b.name
        named = {}
        for value in mapping.values():
            named.setdefault(keras_hub_path(value), []).append(value)
        for path, values in named.items():
            if len(values) > 1:  # halves of one tensor (Qwen3-MoE's gate_up) tile it
                assert all(isinstance(v, Sliced) for v in values), (b.name, path)
                spans = sorted((v.start, v.stop) for v in values)
                assert spans[0][0] == 0, (b.name, path)
                assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), (b.name, path)
    # LoRA: every module names projections the model has
    for paths in family.lora.modules.values():
        for path in paths:
            assert f"block_0/{path}/kernel" in weights, path
    assert len(family.layer_kinds(m)) == m.num_layers
    assert set(family.layer_kinds(m)) <= {"local", "global"}
    if default_backbone(m) is not None:
        assert default_backbone(m) in BACKBONES


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_familys_config_is_read_back(model_type, tmp_path):
    """config.json in: the family's own reader gives the section back; otherwise
    keras-hub's converter for the model_type builds a backbone the family maps."""
    family = FAMILIES[model_type]
    m, _ = _section(model_type)
    r = resolved(m, model_class(m.family).family_defaults)
    config = family.config_out(r, {"vocab_size": m.vocab_size, "tie_word_embeddings":
                                   r.tie_embeddings, "bos_token_id": None,
                                   "eos_token_id": None})
    if family.config_in is not None:
        back = ModelConfig(**family.config_in(config, str(tmp_path)))
        assert vars(resolved(back, model_class(m.family).family_defaults)) == vars(r)
        return
    (tmp_path / "config.json").write_text(json.dumps(config))
    converter = preset_loader(str(tmp_path)).converter
    assert converter.backbone_cls.__name__ in {b.name for b in family.keras_hub}


def test_layer_kinds_follow_the_window_pattern():
    m = ModelConfig(**{**_TINY, "family": "gemma3", "num_layers": 6, "sliding_window": 8,
                       "sliding_window_pattern": 3})
    assert layer_kinds(m) == ["local", "local", "global"] * 2


def test_a_section_no_family_writes_is_one_line():
    m = ModelConfig(**{**_TINY, "family": "llama", "qk_norm": True, "qkv_bias": True})
    with pytest.raises(PretrainedError, match="query/key norms .* no transformers"):
        writer(resolved(m, model_class("llama").family_defaults))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_moe_keras_hub_map_names_every_weight_of_keras_hubs_backbone(model_type):
    """Built twice: Keras numbers the unnamed MoE blocks per process, the names do not."""
    import keras_hub

    from tfllm.internals import abstract_backbone
    m, _ = _section(model_type)
    m.norm_epsilon = 1e-6  # keras-hub's Qwen3-MoE query/key norms' (refused otherwise)
    r = resolved(m, model_class(m.family).family_defaults)
    name = default_backbone(r)
    b = BACKBONES[name]
    assert b in FAMILIES[model_type].keras_hub
    mapping = b.weight_map(r)
    for _ in range(2):
        backbone = abstract_backbone(getattr(keras_hub.models, name),
                                     {**b.backbone_kwargs(r, {}), "dtype": "float32"})
        theirs = {b.variable_name(v.path): tuple(v.shape) for v in backbone.variables}
        assert {keras_hub_path(v) for v in mapping.values()} == set(theirs)
        for value in mapping.values():
            if isinstance(value, Sliced):
                assert theirs[value.path][value.axis] == 2 * (value.stop - value.start)


def test_a_sliced_part_offsets_blocks_and_holds_only_its_shape():
    up = Sliced("experts/gate_up", axis=2, start=8, stop=16)  # (E, D, 2F) -> (E, D, F)
    assert up.block((2, 0, 4), (2, 32, 4)) == ((2, 0, 12), (2, 32, 4))
    assert up.index(3) == (slice(None), slice(None), slice(8, 16))
    assert up.holds((4, 32, 16), (4, 32, 8))
    assert not up.holds((4, 32, 12), (4, 32, 8))  # too short for the second half
    assert not up.holds((4, 32, 16), (4, 32, 4))  # another width
    assert not up.holds((4, 16, 16), (4, 32, 8))  # another axis differs
