"""What every model family declares, and the pieces families share.

A `Family` is one Hugging Face `model_type` tfllm reads and writes (torchtitan keeps a
state-dict adapter per model, keras-hub a converter per architecture): its config.json
fields in and out, its tensors with their orientation, its LoRA module names, the
keras-hub backbones it maps (`Backbone`) and its layer kinds. `tfllm.families` holds the
registry; import, export, PEFT, LoRA and the FLOP count read only from it.

No TensorFlow here, and no model code: a family names tfllm variable paths
("block_0/attention/query/kernel", below the model's name) and model-section fields.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

#: keras-hub config keys that change nothing tfllm computes (dropout is off at inference
#: and tfllm trains without it; name/dtype/trainable are Keras bookkeeping).
IGNORED = {"name", "trainable", "dtype", "dropout"}

#: Context length assumed when a keras-hub preset (unlike a Hugging Face config) does not
#: state one; `--set model.max_sequence_length=N` changes it.
DEFAULT_MAX_LENGTH = 4096


class PretrainedError(ValueError):
    """A preset or checkpoint tfllm cannot import or export; the message names the file,
    the tensor or setting, and the fix."""


# ---- tensors ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Tensor:
    """One tensor of a Hugging Face folder (a model's or an adapter's), made from tfllm
    checkpoint variables (`tfllm.pretrained.hf_export`, `tfllm.pretrained.peft`)."""

    key: str                          # the Hugging Face name
    sources: Tuple[str, ...]          # tfllm variable paths below the model's name
    shape: Tuple[int, ...]            # the Hugging Face shape
    make: Callable[..., np.ndarray]   # (*source arrays) -> array of `shape`


def same(x):
    return x


def linear(x):
    """A kernel (in, ...) or (..., out) laid out as tfllm's einsum uses it -> a
    torch nn.Linear weight (out, in)."""
    return x.T


@dataclass(frozen=True)
class Permuted:
    """A keras-hub weight-map value whose tensor is tfllm's with its axes permuted:
    tfllm's = np.transpose(keras-hub's, perm)."""

    path: str
    perm: Tuple[int, ...]

    def to_ours(self, theirs):
        return np.transpose(theirs, self.perm)

    def to_theirs(self, ours):
        return np.transpose(ours, np.argsort(self.perm))


@dataclass(frozen=True)
class Sliced:
    """A keras-hub weight-map value whose tensor holds tfllm's and others' side by side
    along `axis` (keras-hub's Qwen3-MoE experts keep gate and up as one (E, D, 2F)
    kernel): tfllm's = keras-hub's[..., start:stop, ...] on that axis. The slices of one
    keras-hub tensor together fill it exactly (`tests/families` checks)."""

    path: str
    axis: int
    start: int
    stop: int

    def block(self, start, size):
        """tfllm's block (start, size) -> the same block of keras-hub's tensor."""
        begin = list(start)
        begin[self.axis] += self.start
        return tuple(begin), tuple(size)

    def holds(self, theirs, ours) -> bool:
        """Whether keras-hub's tensor of shape `theirs` holds tfllm's of shape `ours` here:
        the other axes equal, this one long enough."""
        a = self.axis
        others = lambda shape: tuple(shape[:a]) + tuple(shape[a + 1:])  # noqa: E731
        return (others(theirs) == others(ours) and self.stop - self.start == ours[a]
                and self.stop <= theirs[a])

    def index(self, ndim: int) -> tuple:
        """Where tfllm's part lies in keras-hub's tensor (of `ndim` axes)."""
        index = [slice(None)] * ndim
        index[self.axis] = slice(self.start, self.stop)
        return tuple(index)


def keras_hub_path(value) -> str:
    """The keras-hub variable path of a weight-map value (a path, `Permuted`, `Sliced`)."""
    return value.path if isinstance(value, (Permuted, Sliced)) else value


def keras_hub_name(path: str, unnamed: Sequence[str] = ()) -> str:
    """A keras-hub variable path with the counter Keras appends to a layer created
    without a name dropped (`Backbone.unnamed`: "transformer_layer_2/
    qwen3_sparse_moe_block_3/..." -> ".../qwen3_sparse_moe_block/..."). Keras numbers such
    layers per process, so the path of the same weight changes with what was built
    before; the weight files do not depend on it (they name the object graph)."""
    if not unnamed:
        return path
    parts = path.split("/")
    for i, part in enumerate(parts):
        base = re.sub(r"_\d+$", "", part)
        if base in unnamed:
            parts[i] = base
    return "/".join(parts)


# ---- keras-hub --------------------------------------------------------------------------
@dataclass(frozen=True)
class Backbone:
    """How one keras-hub backbone class maps onto a tfllm model.

    Attributes:
      name: the keras-hub class name ("Llama3Backbone").
      model_family: the tfllm model.family that computes it.
      description: what it holds, for `supported()`.
      model_fields: (keras-hub config, max_length=None) -> tfllm's model section.
      backbone_kwargs: (model section, the imported keras-hub config or {}) -> the
        backbone's arguments, for export (keys tfllm does not model, such as dropout,
        come from the imported config).
      weight_map: model section -> {tfllm variable path: keras-hub variable path, or a
        `Permuted` where the axes differ}. Shapes are otherwise equal on both sides.
      understood: the keras-hub config keys tfllm implements (others are refused).
      unnamed: layers the backbone creates without a name, whose automatic names
        carry a per-process counter (`variable_name` drops it: `keras_hub_name`).
      check: (keras-hub config, where) -> None, raising a PretrainedError for a value
        of an understood key that tfllm does not compute.
    """

    name: str
    model_family: str
    description: str
    model_fields: Callable[..., dict]
    backbone_kwargs: Callable[[object, dict], dict]
    weight_map: Callable[[object], Dict[str, object]]
    understood: frozenset
    unnamed: Tuple[str, ...] = ()
    check: Optional[Callable[[dict, str], None]] = None

    def variable_name(self, path: str) -> str:
        """The name of keras-hub variable `path` in `weight_map` (`keras_hub_name`)."""
        return keras_hub_name(path, self.unnamed)


def check_understood(backbone: Backbone, kh: dict, source: str) -> None:
    """Refuses a keras-hub config key the tfllm model does not implement, and a value
    the backbone's `check` refuses."""
    unknown = sorted(k for k in kh if k not in backbone.understood and k not in IGNORED)
    if unknown:
        raise PretrainedError(
            f"{source}: the {backbone.name} config sets {unknown}, which tfllm's "
            f"{backbone.model_family} model does not implement; supported settings: "
            f"{sorted(backbone.understood)}.")
    if backbone.check is not None:
        backbone.check(kh, source)


# ---- LoRA -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraNames:
    """How a family's Hugging Face modules are named for LoRA (peft's target_modules).

    Attributes:
      modules: {Hugging Face module name inside layer i: tfllm projection paths inside
        block_i}; a fused module (GPT-2's attn.c_attn) is several tfllm projections.
      layer_prefix: where layer i's modules live ("model.layers.{i}.").
      fan_in_fan_out: the modules are Conv1D, weights (in, out) (peft's flag).
      vllm_refusal: why vLLM refuses this family's adapters, or None.
      experts: {Hugging Face parameter name inside layer i: tfllm projection paths}: the
        stacked expert parameters of a mixture-of-experts layer, which peft adapts through
        `target_parameters` (its ParamWrapper: per expert one A (r, in) shared by the
        paths and one B (out, r), out the paths' outputs stacked), in the order the
        Hugging Face module registers them (peft nests its wrappers so: the first is the
        innermost, its adapter named `...experts.base_layer.lora_A` under a second). They
        exist on sparse layers only, and a module whose paths they share (the dense MLP's)
        on dense layers only.
    """

    modules: Dict[str, Tuple[str, ...]]
    layer_prefix: str
    fan_in_fan_out: bool = False
    vllm_refusal: Optional[str] = None
    experts: Dict[str, Tuple[str, ...]] = field(default_factory=dict)


# ---- layer kinds ------------------------------------------------------------------------
def is_local_layer(config, index: int) -> bool:
    """Whether layer `index` of a model section attends within model.sliding_window: all
    layers with a window, except every model.sliding_window_pattern-th (N-1, 2N-1, ...)."""
    pattern = config.sliding_window_pattern
    return bool(config.sliding_window) and not (pattern and (index + 1) % pattern == 0)


def is_moe_layer(config, index: int) -> bool:
    """Whether layer `index` of a model section has a mixture of experts for its MLP
    (Qwen3-MoE's rule, which is Mixtral's with the defaults): model.num_experts > 0,
    (index + 1) a multiple of model.decoder_sparse_step, index not in
    model.mlp_only_layers."""
    return (bool(getattr(config, "num_experts", 0))
            and (index + 1) % config.decoder_sparse_step == 0
            and index not in config.mlp_only_layers)


def layer_kinds(config) -> List[str]:
    """"local" (attends within model.sliding_window) or "global", for each layer."""
    return ["local" if is_local_layer(config, i) else "global"
            for i in range(config.num_layers)]


# ---- the family -------------------------------------------------------------------------
#: A config.json key keras-hub's converter does not read but which changes what a model
#: computes: (key, accepted(value, config), what tfllm computes). A value outside
#: `accepted` is refused, naming the key and value, instead of being dropped.
Refused = Tuple[str, Callable[[object, dict], bool], str]

#: refused for every model_type
REFUSED_EVERYWHERE: Tuple[Refused, ...] = (
    ("quantization_config", lambda v, c: v is None, "float weights"),
    ("attn_logit_softcapping", lambda v, c: v is None, "no logit soft-capping"),
    ("final_logit_softcapping", lambda v, c: v is None, "no logit soft-capping"),
)


@dataclass(frozen=True)
class Family:
    """One Hugging Face model_type tfllm imports and exports, and all it needs.

    Model sections given to `writes`, `config_out` and `tensors` are `resolved` (null
    tie_embeddings / use_bias / qkv_bias as the model class computes them).

    Attributes:
      model_type: transformers' model_type ("llama").
      architecture: transformers' class in config.json's "architectures".
      model_family: the tfllm model.family whose code computes it.
      writes: (model section, the keras-hub backbone a run was imported from or None)
        -> whether this family writes the section; exactly one family does, and one that
        would but cannot express a setting raises a PretrainedError naming it.
      config_out: (model section, the keys every config.json has) -> config.json.
      tensors: model section -> every tensor of the folder, in the order written.
      lora: its LoRA module names.
      keras_hub: the keras-hub backbones that hold it (import through keras-hub's
        converter, and `tfllm export --format keras-hub`).
      default_backbone: raw model section -> the keras-hub class a run that was not
        imported exports to, when this family is the one; else None.
      refused: config.json keys keras-hub's converter would silently drop.
      config_in: (config.json, folder) -> tfllm's model section, for a family whose
        keras-hub backbone cannot express every setting transformers has (Gemma 3's layer
        pattern and RoPE bases); None: through keras-hub's converter and `model_fields`.
      layer_kinds: model section -> "local" / "global" for each layer.
      tensors_in: (model section, the folder's tensor names) -> the `Tensor`s a Hugging
        Face folder holds, which tfllm reads itself, each tfllm variable assembled from
        the tensors naming it (`tfllm.pretrained.direct`; with `config_in`); None:
        through keras-hub's converter (`keras_hub`).
    """

    model_type: str
    architecture: str
    model_family: str
    writes: Callable[[object, Optional[str]], bool]
    config_out: Callable[[object, dict], dict]
    tensors: Callable[[object], List[Tensor]]
    lora: LoraNames
    keras_hub: Tuple[Backbone, ...]
    default_backbone: Callable[[object], Optional[str]]
    refused: Tuple[Refused, ...] = ()
    config_in: Optional[Callable[[dict, str], dict]] = None
    layer_kinds: Callable[[object], List[str]] = layer_kinds
    tensors_in: Optional[Callable[[object, Sequence[str]], List[Tensor]]] = None


def resolved(m, defaults: dict):
    """A copy of model section `m` with tie_embeddings, use_bias and qkv_bias resolved as
    the model class does: null takes the class's `family_defaults` (qkv_bias: use_bias).
    """
    out = copy.copy(m)
    tie = defaults["tie_embeddings"] if m.tie_embeddings is None else m.tie_embeddings
    bias = defaults["use_bias"] if m.use_bias is None else m.use_bias
    out.tie_embeddings, out.use_bias = bool(tie), bool(bias)
    out.qkv_bias = bool(m.qkv_bias) if m.qkv_bias is not None else bool(bias)
    return out


def head_dim(m) -> int:
    return m.head_dim or m.hidden_dim // m.num_query_heads


def rope_parameters(m) -> dict:
    """transformers 5's rope_parameters of a model section's (global) RoPE."""
    rope = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    if m.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=float(m.rope_scaling_factor))
    elif m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=float(m.rope_scaling_factor),
                    low_freq_factor=float(m.rope_low_freq_factor),
                    high_freq_factor=float(m.rope_high_freq_factor),
                    original_max_position_embeddings=int(m.rope_original_max_length))
    elif m.rope_scaling != "none":
        raise PretrainedError(f"model.rope_scaling={m.rope_scaling!r} has no transformers "
                              "counterpart tfllm writes (none, linear, llama3).")
    return rope


def config_reader(read: Callable[[dict, str], dict], kind: Optional[str] = None):
    """A `Family.config_in` from `read(config, where)` (where: the config.json's path):
    a missing or ill-typed key becomes one PretrainedError naming the file; `kind` names
    the config in it (default: its model_type)."""
    def config_in(c: dict, path: str) -> dict:
        where = f"{path}/config.json"
        try:
            return read(c, where)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, PretrainedError):
                raise
            raise PretrainedError(f"{where}: not a {kind or c.get('model_type')} config "
                                  f"tfllm can read ({type(e).__name__}: {e}); the file is "
                                  "damaged or incomplete.") from None
    return config_in
