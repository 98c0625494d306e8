"""Loading, overriding, validating and saving configs.

A config is the schema's defaults, then a YAML file's values (strict: every key must
exist in the schema), then `--set section.key=value` overrides, in that order.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Iterable, Optional

import yaml

from tfllm.config import schema
from tfllm import files
from tfllm.confined import read_regular
from tfllm.runpaths import RunPaths
from tfllm.runtime.devices import MAX_CPU_DEVICES


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and the fix."""


#: The deepest nesting a config has is 3 (section, key, a [logical, mesh] pair of
#: mesh.rules); deeper YAML is no config, and each level costs the composer a Python frame.
MAX_YAML_DEPTH = 8
#: A config file or run config.yaml is a few KiB; more is no config (nor read whole).
MAX_CONFIG_BYTES = 1 << 20
#: Integer settings are int64 in TensorFlow and NumPy; a field's own `max` may be lower.
_INT_LIMIT = 2 ** 63 - 1


class _Unbounded(ConfigError):
    """YAML a config never holds and that costs unbounded work: an alias, deep nesting."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases and with a nesting limit: a config needs
    neither, and each lets a small text cost unbounded time and memory (an alias that
    repeats an alias, a "billion laughs") or stack (a list nested 20,000 deep)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _Unbounded(f"a YAML alias (*{self.peek_event().anchor}) at line "
                              f"{self.peek_event().start_mark.line + 1}; tfllm configs take "
                              "no aliases or anchors: write the value out.")
        if self._depth >= MAX_YAML_DEPTH:
            raise _Unbounded(f"nested deeper than {MAX_YAML_DEPTH} levels at line "
                              f"{self.peek_event().start_mark.line + 1}; a tfllm config is "
                              "sections of keys (mesh.rules: a list of pairs).")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def safe_yaml(text: str, source: str):
    """`text` parsed as YAML by the bounded loader; ConfigError naming `source` when it
    is not YAML, holds an alias, nests too deep or holds a number Python will not read
    (an integer of more than 4300 digits)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except _Unbounded as e:
        raise _Unbounded(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    except ValueError as e:  # int() of a too-long number in the constructor
        raise ConfigError(f"{source}: holds a number too long to read ({e}); give a "
                          "number of the setting's range.") from None
    finally:
        loader.dispose()


def _shown(value: Any) -> str:
    """repr(value), cut to a length one line of an error can hold."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _closest(name: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def _fields(obj) -> dict:
    return {f.name: f for f in dataclasses.fields(obj)}


def _coerce(key: str, fld: dataclasses.Field, value: Any) -> Any:
    """Checks `value` against the field's type and range; returns the typed value."""
    # The schema uses `from __future__ import annotations`, so types are strings.
    hint = str(fld.type).replace("typing.", "")
    optional = hint.startswith("Optional[")
    base = hint[len("Optional["):-1] if optional else hint
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: null is not allowed; give a {base}.")
    if base == "bool":
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.lower() in ("true", "false"):
            out = value.lower() == "true"
        else:
            raise ConfigError(f"{key}: expected true or false, got {_shown(value)}.")
    elif base == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}: expected an integer, got {_shown(value)}.")
        try:
            out = int(value)
        except ValueError:  # also a string of more than 4300 digits
            raise ConfigError(f"{key}: expected an integer, got {_shown(value)}.") from None
        if abs(out) > _INT_LIMIT:  # before the range checks: a field may have no max
            raise ConfigError(f"{key}: {_shown(value)} is out of range; integer settings "
                              f"are at most {_INT_LIMIT} (int64).")
    elif base == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {_shown(value)}.")
        try:
            out = float(value)
        except OverflowError:  # an integer beyond float64, e.g. 400 digits
            out = math.inf
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {_shown(value)}.") from None
        # Before the range checks: every comparison with NaN is False, so nan would pass
        # them. No float setting takes an infinity (each has a finite "off" value).
        if not math.isfinite(out):
            raise ConfigError(f"{key}: {_shown(value)} is not a finite number; give a "
                              "finite value.")
    elif base == "str":
        if isinstance(value, bool):
            value = "true" if value else "false"
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{key}: expected a string, got {_shown(value)}.")
        out = str(value)
    elif base == "List[str]":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {_shown(value)}.")
        out = list(value)
    elif base == "List[int]":
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        try:
            ok = isinstance(value, list) and not any(isinstance(v, bool) for v in value)
            out = [int(v) for v in value] if ok else None
        except (TypeError, ValueError):
            out = None
        if out is None:
            raise ConfigError(f"{key}: expected a list of integers, got {_shown(value)}.")
    elif base == "List[List[str]]":
        ok = isinstance(value, list) and all(
            isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], str)
            and (v[1] is None or isinstance(v[1], str)) for v in value)
        if not ok:
            raise ConfigError(f"{key}: expected a list of [logical_axis, mesh_axis] pairs, "
                              f"got {_shown(value)}.")
        out = [[v[0], v[1] if v[1] not in (None, "null", "none") else None] for v in value]
    else:  # pragma: no cover - a schema field of a type this loader does not know
        raise ConfigError(f"{key}: unsupported field type {hint}.")
    meta = fld.metadata
    for item in (out if isinstance(out, list) else [out]):  # a list's choices: each item's
        if "choices" in meta and item not in meta["choices"]:
            raise ConfigError(f"{key}: {_shown(item)} is not one of {list(meta['choices'])}."
                              + _closest(str(item)[:100], map(str, meta["choices"])))
    if "min" in meta and out < meta["min"]:
        raise ConfigError(f"{key}: {_shown(out)} is below the minimum {meta['min']}.")
    if "max" in meta and out > meta["max"]:
        raise ConfigError(f"{key}: {_shown(out)} is above the maximum {meta['max']}.")
    return out


def _set(cfg: schema.Config, dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{source}: '{dotted}' must be section.key, e.g. model.hidden_dim "
                          f"(sections: {', '.join(schema.SECTIONS)}).")
    section, key = parts
    if section not in schema.SECTIONS:
        raise ConfigError(f"{source}: unknown section '{section}'."
                          + _closest(section, schema.SECTIONS))
    sub = getattr(cfg, section)
    flds = _fields(sub)
    if key not in flds:
        raise ConfigError(f"{source}: unknown key '{section}.{key}'."
                          + _closest(key, flds).replace("'", f"'{section}.", 1))
    setattr(sub, key, _coerce(f"{section}.{key}", flds[key], value))


def apply_dict(cfg: schema.Config, data: dict, source: str) -> None:
    """Applies a nested {section: {key: value}} mapping strictly onto `cfg`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"({', '.join(schema.SECTIONS)}), got {type(data).__name__}.")
    for section, values in data.items():
        if section not in schema.SECTIONS:
            raise ConfigError(f"{source}: unknown section '{section}'."
                              + _closest(str(section), schema.SECTIONS))
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys.")
        for key, value in values.items():
            try:
                _set(cfg, f"{section}.{key}", value, source)
            except ConfigError as e:  # a value's error names the file it is in
                text = str(e)
                raise ConfigError(text if text.startswith(source) else f"{source}: {text}"
                                  ) from None


def parse_override(text: str) -> tuple:
    """Splits 'section.key=value' and parses value as YAML (so 3 is an int)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value.")
    key, raw = text.split("=", 1)
    try:
        value = safe_yaml(raw, f"--set {key.strip()}") if raw.strip() else ""
    except _Unbounded:
        raise
    except ConfigError:
        value = raw  # not YAML: the setting's own check names it (a string, a number)
    return key.strip(), value


def config_from_dict(data: dict, overrides: Iterable[str] = (),
                     source: str = "config") -> schema.Config:
    """A validated Config from defaults, a nested {section: {key: value}} mapping (e.g. a
    model section derived from a pretrained preset) and 'section.key=value' overrides."""
    cfg = schema.Config()
    apply_dict(cfg, data, source)
    for text in overrides:
        key, value = parse_override(text)
        _set(cfg, key, value, f"--set {text}")
    validate(cfg)
    return cfg


def read_config_file(path: str) -> dict:
    """The {section: {key: value}} mapping of a YAML config file (not yet validated)."""
    if not os.path.exists(path):
        raise ConfigError(f"--config {path}: no such file. Presets live in configs/ "
                          "(e.g. configs/tiny.yaml).")
    raw = read_regular(path, MAX_CONFIG_BYTES, "a YAML config", ConfigError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte offset {e.start}); save it as "
                          "UTF-8.") from None
    return safe_yaml(text, path) or {}


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> schema.Config:
    """Builds a validated Config from defaults, an optional YAML file and overrides.

    Args:
      path: a YAML file of overrides, or None for the defaults.
      overrides: strings 'section.key=value', applied after the file.
    """
    data = read_config_file(path) if path else {}
    return config_from_dict(data, overrides, path or "config")


def profile_steps(train) -> Optional[tuple]:
    """`train.profile_steps` as (first, last) step numbers, or None when empty."""
    text = str(train.profile_steps).strip()
    if not text:
        return None
    parts = text.split("-")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ConfigError(f"train.profile_steps={text!r}: give FIRST-LAST step numbers "
                          "(e.g. 5-7) or one step (5), counting from 1.")
    if last > train.steps:
        raise ConfigError(f"train.profile_steps={text!r}: the run has {train.steps} steps; "
                          "trace steps it runs.")
    return first, last


def validate(cfg: schema.Config) -> None:
    """Cross-field checks that a single field's range cannot express."""
    m = cfg.model
    if m.head_dim == 0 and m.hidden_dim % m.num_query_heads:
        raise ConfigError(f"model.hidden_dim ({m.hidden_dim}) must be divisible by "
                          f"model.num_query_heads ({m.num_query_heads}), or set model.head_dim.")
    kv = m.num_key_value_heads or m.num_query_heads
    if m.num_query_heads % kv:
        raise ConfigError(f"model.num_query_heads ({m.num_query_heads}) must be a multiple of "
                          f"model.num_key_value_heads ({kv}).")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must "
                          f"exceed model.rope_low_freq_factor ({m.rope_low_freq_factor}) for "
                          "rope_scaling=llama3 (Llama 3.1 uses 4.0 and 1.0).")
    if m.attention == "cudnn":
        raise ConfigError("model.attention=cudnn: TensorFlow 2.21's DTensor cannot run "
                          "cuDNN's fused attention inside a step (docs/design.md: 'Fused (cuDNN) "
                          "attention on a DTensor mesh'); use model.attention=xla, with "
                          "model.attention_chunk for long sequences.")
    if cfg.train.profile_steps:
        profile_steps(cfg.train)  # ConfigError when malformed
    if m.qk_norm and m.family == "gpt":
        raise ConfigError("model.qk_norm=true is a llama-family setting (Qwen3); the gpt "
                          "family has no query/key norms: set model.family=llama.")
    rope_only = [f"{k}={getattr(m, k)}" for k in ("sliding_window", "sliding_window_pattern",
                                                   "rope_local_theta", "query_pre_attn_scalar")
                 if getattr(m, k)]
    if rope_only and m.family == "gpt":
        raise ConfigError(f"model.{rope_only[0]} is a setting of the llama and gemma3 "
                          "families; the gpt family has none: leave it 0.")
    check_experts(m, cfg.precision)
    if m.sliding_window_pattern and not m.sliding_window:
        raise ConfigError(f"model.sliding_window_pattern={m.sliding_window_pattern} needs "
                          "model.sliding_window (the local layers' window), e.g. 4096.")
    if cfg.data.sequence_length > m.max_sequence_length:
        raise ConfigError(f"data.sequence_length ({cfg.data.sequence_length}) exceeds "
                          f"model.max_sequence_length ({m.max_sequence_length}); lower it or "
                          "raise model.max_sequence_length.")
    d = cfg.data
    if d.source in ("text", "tfrecord") and not d.paths:
        raise ConfigError(f"data.paths is empty but data.source is {d.source}; name the "
                          "training files, e.g. --set data.paths=[\"corpus/*.txt\"].")
    if d.source == "tfds" and not d.tfds_name:
        raise ConfigError("data.tfds_name is empty but data.source is tfds; name a dataset, "
                          "e.g. --set data.tfds_name=lm1b.")
    if d.source != "synthetic" and d.tokenizer == "file" and not d.tokenizer_path:
        raise ConfigError("data.tokenizer is file but data.tokenizer_path is empty; name a "
                          "SentencePiece .model file or a keras-hub tokenizer preset directory.")
    if d.source != "synthetic" and d.tokenizer == "byte" and m.vocab_size < 257:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is too small for data.tokenizer="
                          "byte, which needs 257 ids (256 bytes + end of document); set "
                          "model.vocab_size=257 or more.")
    t = cfg.train
    if t.global_batch_size % t.grad_accum_steps:
        raise ConfigError(f"train.global_batch_size ({t.global_batch_size}) must be divisible "
                          f"by train.grad_accum_steps ({t.grad_accum_steps}).")
    bad = set(cfg.optimizer.weight_decay_exclude) - {"bias", "norm", "embedding"}
    if bad:
        raise ConfigError(f"optimizer.weight_decay_exclude: unknown kind(s) {sorted(bad)}; "
                          "use bias, norm, embedding.")
    if cfg.lora.rank > m.hidden_dim:
        # Every projection reads or writes the residual stream, so rank(A B) <= hidden_dim:
        # a larger rank adds no capacity, only memory (refused before it is allocated).
        raise ConfigError(f"lora.rank={cfg.lora.rank} is above model.hidden_dim "
                          f"({m.hidden_dim}): an adapter's update A B has rank at most "
                          f"min(in, out) <= {m.hidden_dim}, so a larger rank only allocates "
                          f"memory; use lora.rank <= {m.hidden_dim} (commonly 8 to 64).")
    elements = weight_elements(m)[1]
    if elements > MAX_WEIGHT_ELEMENTS:
        raise ConfigError(f"model: the sizes give up to {elements:.3g} weights (vocab_size "
                          f"{m.vocab_size}, hidden_dim {m.hidden_dim}, num_layers "
                          f"{m.num_layers}, intermediate_dim {m.intermediate_dim}), more than "
                          f"the {MAX_WEIGHT_ELEMENTS:.3g} a tfllm model holds; lower them.")
    from tfllm.parallel import mesh as mesh_lib  # parsing only, no TensorFlow
    if cfg.mesh.num_cpu_devices > MAX_CPU_DEVICES:
        raise ConfigError(f"mesh.num_cpu_devices: {cfg.mesh.num_cpu_devices} is above the "
                          f"maximum {MAX_CPU_DEVICES} logical CPU devices of one "
                          "host; lower it (0: as many as the mesh needs).")
    try:
        mesh_lib.parse_axes(cfg.mesh.axes, mesh_axes_known(cfg))
    except mesh_lib.MeshError as e:
        raise ConfigError(str(e)) from None
    check_objective(cfg)


def check_experts(m: schema.ModelConfig,
                  precision: Optional[schema.PrecisionConfig] = None) -> None:
    """Refuses a mixture-of-experts model section tfllm cannot build (what LoRA on its
    experts cannot be: `tfllm.models.lora.targeted`)."""
    if not m.num_experts:
        return
    if precision is not None and precision.policy == "fp8" and m.moe_dispatch == "grouped":
        # the expert kernels of the sparse layers (the rule of families.base.is_moe_layer)
        paths = [f"block_{i}/mlp/{name}" for i in range(m.num_layers)
                 if (i + 1) % m.decoder_sparse_step == 0 and i not in m.mlp_only_layers
                 for name in ("gate", "up", "down")]
        if any(not any(e in p for e in precision.fp8_exclude) for p in paths):
            raise ConfigError("precision.policy=fp8 with model.moe_dispatch=grouped: FP8 "
                              "expert GEMMs need the slots dispatch (the grouped matmul has "
                              "no FP8 form); set model.moe_dispatch=slots, or keep the MLPs "
                              "in bf16 with precision.fp8_exclude=[mlp].")
    if m.family != "llama":
        raise ConfigError(f"model.num_experts={m.num_experts}: mixtures of experts are "
                          f"llama-family models (Qwen3-MoE, Mixtral); set model.family=llama "
                          f"or model.num_experts=0.")
    if m.num_experts_per_tok > m.num_experts:
        raise ConfigError(f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds "
                          f"model.num_experts={m.num_experts}; route each token to at most "
                          "every expert.")
    if m.moe_capacity_factor and m.moe_dispatch != "slots":
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} with "
                          f"model.moe_dispatch={m.moe_dispatch}, which is dropless; set "
                          "model.moe_dispatch=slots, or model.moe_capacity_factor=0.")
    outside = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
    if outside:
        raise ConfigError(f"model.mlp_only_layers={m.mlp_only_layers}: {outside} are not "
                          f"layers of this {m.num_layers}-layer model (0 .. "
                          f"{m.num_layers - 1}).")


def check_objective(cfg: schema.Config) -> None:
    """train.objective, data.format, lora and the dpo section go together."""
    t, d = cfg.train, cfg.data
    if (t.objective == "dpo") != (d.format == "preference"):
        raise ConfigError(
            f"train.objective={t.objective} with data.format={d.format}: preference pairs "
            "train with DPO and DPO trains on pairs; set both train.objective=dpo and "
            "data.format=preference, or neither.")
    if cfg.dpo.precompute_reference and cfg.dpo.loss == "orpo":
        raise ConfigError("dpo.precompute_reference=true with dpo.loss=orpo: ORPO has no "
                          "reference model to precompute; set dpo.precompute_reference "
                          "to false.")
    if (t.objective == "dpo" and cfg.lora.rank == 0 and cfg.dpo.loss != "orpo"
            and cfg.precision.policy == "fp8"):
        raise ConfigError(
            "train.objective=dpo with lora.rank=0 and precision.policy=fp8: the reference "
            "(a frozen copy, or the precomputed pass) would use its first FP8 scales for "
            "the whole run; use "
            "precision.policy=bfloat16, or LoRA (lora.rank > 0: the reference is the "
            "model with its adapters off).")
    if cfg.dpo.rpo_alpha and cfg.dpo.loss == "orpo":
        raise ConfigError(f"dpo.rpo_alpha={cfg.dpo.rpo_alpha} with dpo.loss=orpo: ORPO "
                          "has its own NLL term (weight 1); set dpo.rpo_alpha to 0.")
    if cfg.dpo.label_smoothing and cfg.dpo.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing={cfg.dpo.label_smoothing} applies to "
                          f"dpo.loss=sigmoid only (it is {cfg.dpo.loss}); set it to 0.")


#: the most weights a model holds (2**40, about 1.1 trillion: 4.4 TB in float32)
MAX_WEIGHT_ELEMENTS = 2 ** 40


def weight_elements(m: schema.ModelConfig) -> tuple:
    """(lower, upper) bounds of the number of weights of model config `m`, from its sizes
    alone: nothing is built, so an absurd size is refused before it is allocated (the exact
    count is `tfllm.footprint.layout.param_count`, which builds the model unallocated).
    The bounds differ by what the family decides: a tied head, learned positions, a gated
    MLP, biases and norms."""
    head_dim = m.head_dim or max(m.hidden_dim // m.num_query_heads, 1)
    kv = m.num_key_value_heads or m.num_query_heads
    attention = m.hidden_dim * head_dim * 2 * (m.num_query_heads + kv)  # q, o; k, v
    mlp = m.hidden_dim * m.intermediate_dim
    lower = m.vocab_size * m.hidden_dim + m.num_layers * (attention + 2 * mlp)
    upper = ((2 * m.vocab_size + m.max_sequence_length) * m.hidden_dim
             + m.num_layers * (attention + 3 * mlp + 4 * m.hidden_dim + m.intermediate_dim))
    return lower, upper


def mesh_axes_known(cfg: schema.Config):
    """Mesh axis names the config's rules table refers to."""
    from tfllm.parallel import rules as rules_lib
    if not cfg.mesh.rules:
        return rules_lib.KNOWN_MESH_AXES
    return rules_lib.mesh_axes_of(rules_lib.rules_from_config(cfg.mesh.rules))


def to_dict(cfg: schema.Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: schema.Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: schema.Config, workdir: str) -> str:
    """Writes the resolved config to WORKDIR/config.yaml (a run's or an export's folder)
    atomically (config.yaml.tmp, then renamed; a link planted at either name is refused);
    returns the path."""
    path = RunPaths(workdir).config_file
    files.write_atomically(workdir, path, dump_yaml(cfg))
    return path
