"""LoRA adapters across the border: PEFT folders out and in, and merged weights.

`tfllm export --format peft` writes what `peft.PeftModel.from_pretrained` loads onto the
Hugging Face base model and what vLLM serves with `--enable-lora`:

* `adapter_config.json`: `peft_type` LORA, `r`, `lora_alpha`, `use_rslora`,
  `target_modules` (Hugging Face module names), `bias` "none", `task_type` CAUSAL_LM;
* `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight` of shape
  [r, in] and `...lora_B.weight` of shape [out, r] (torch's Linear orientation), so that
  the module computes W x + s B A x with s = lora_alpha / r (/ sqrt(r) with rsLoRA).

tfllm's A is (the kernel's input dimensions..., r) and B (r, its output dimensions...):
flattened, A^T and B^T are peft's. GPT-2's fused `attn.c_attn` (query | key | value) is
three tfllm projections with an adapter each: exported as one adapter of rank 3r whose
A stacks the three and whose B is block-diagonal (exactly the same update), with
`rank_pattern` / `alpha_pattern` keeping its scale. vLLM's GPT-2 takes no LoRA, so GPT-2
adapters are refused unless `vllm_check=False`; the merged export serves everywhere.

A mixture of experts' expert adapters are peft's `target_parameters` on transformers'
fused `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (its ParamWrapper): per
parameter `lora_A` (E r, in) and `lora_B` (out, r E), gate_up's rows the gate's then the
up's, one A for both (see `_expert_module` for their nested names). vLLM does not serve
them, and peft cannot load adapters on a Qwen3-MoE's dense MLP (`peft_refusal`).

Adapters read back (`tfllm import --adapter DIR`) become the run's `lora` settings and
its A and B weights: a standard peft adapter (one rank and alpha, no DoRA, no
`modules_to_save`) onto the base it was trained on.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np

from tfllm.families import Family, LoraNames, PretrainedError, Tensor, lora_names
from tfllm.models.lora import a_source, expert_adapter, matches, scale, targeted

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: the ranks vLLM's --max-lora-rank accepts (vllm/config/lora.py)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_PEFT_PREFIX = "base_model.model."


def _target_names(names: LoraNames, modules: List[str]) -> List[str]:
    """peft target_modules for these modules: the last part of a name where it names no
    other module of the family (q_proj), else the dotted name (attn.c_proj)."""
    table = names.modules
    out = []
    for m in modules:
        leaf = m.rsplit(".", 1)[-1]
        out.append(leaf if sum(matches(t, leaf) for t in table) == 1 else m)
    return out


def _flat_a(a):
    """tfllm A (in..., r) -> peft lora_A (r, in)."""
    return a.reshape(-1, a.shape[-1]).T


def _flat_b(b):
    """tfllm B (r, out...) -> peft lora_B (out, r)."""
    return b.reshape(b.shape[0], -1).T


def adapter_tensors(m, family: Family, lora) -> Tuple[List[Tensor], dict]:
    """The adapter's tensors (from checkpoint variables) and its peft rank/alpha patterns.

    Args:
      m: the run's model config.
      family: the family it is written as (`tfllm.pretrained.hf_export.family_for`).
      lora: the run's lora config (rank > 0).
    """
    r = lora.rank
    tensors, patterns = [], {"rank_pattern": {}, "alpha_pattern": {}}
    for i, layer in enumerate(targeted(m, lora)):
        prefix = _PEFT_PREFIX + family.lora.layer_prefix.format(i=i)
        wrapped = [x.name for x in layer if x.experts]
        for x in layer:
            sources = [f"block_{i}/{p}" for p in x.paths]
            b_src = tuple(s + "/lora_b" for s in sources)
            if x.experts:
                key = prefix + _expert_module(x.name, wrapped)
                e, d_in = m.num_experts, _in_size(m, x.paths[0], True)
                tensors.append(Tensor(key + ".lora_A.weight", (sources[0] + "/lora_a",),
                                      (e * r, d_in), _experts_a))
                tensors.append(Tensor(key + ".lora_B.weight", b_src, (sum(
                    _out_size(m, p, True) for p in x.paths), r * e), _experts_b))
                continue
            a_src = tuple(s + "/lora_a" for s in sources)
            if len(x.paths) == 1:
                a_make, b_make = _flat_a, _flat_b
                rank = r
            else:  # GPT-2's c_attn: one rank-3r adapter, block-diagonal B
                def a_make(*a):
                    return np.concatenate([_flat_a(x) for x in a], axis=0)

                def b_make(*b):
                    flat = [_flat_b(x) for x in b]
                    out = np.zeros((sum(f.shape[0] for f in flat), r * len(flat)), flat[0].dtype)
                    row = 0
                    for k, f in enumerate(flat):
                        out[row:row + f.shape[0], k * r:(k + 1) * r] = f
                        row += f.shape[0]
                    return out
                rank = r * len(x.paths)
                leaf = x.name.rsplit(".", 1)[-1]
                patterns["rank_pattern"][leaf] = rank
                # the same scale s at rank 3r: alpha' / 3r = alpha / r (rsLoRA: / sqrt)
                patterns["alpha_pattern"][leaf] = lora.alpha * (
                    math.sqrt(len(x.paths)) if lora.rslora else len(x.paths))
            tensors.append(Tensor(prefix + x.name + ".lora_A.weight", a_src,
                                  (rank, _in_size(m, x.paths[0])), a_make))
            tensors.append(Tensor(prefix + x.name + ".lora_B.weight", b_src,
                                  (sum(_out_size(m, p) for p in x.paths), rank), b_make))
    return tensors, patterns


# ---- expert parameters (peft's target_parameters, its ParamWrapper) ----------------------
# peft adapts a 3-D parameter (E, out, in) (transformers' F.linear orientation) with
# lora_A (E r, in), row e r + k (expert-major), and lora_B (out, r E), column k E + e
# (rank-major): expert e's update is s B[:, k E + e] A[e r + k, :] summed over k. tfllm's
# A (E, in, r) and B (r, E, out) are the same numbers in another order.

def _expert_module(name: str, wrapped: List[str]) -> str:
    """peft's module name of an expert parameter's adapter: peft wraps the parameters of
    one module in their registration order (`LoraNames.experts`), each wrapper around the
    last, so an earlier one sits `base_layer.` deeper per later one
    (mlp.experts.base_layer.lora_A for gate_up_proj under down_proj's mlp.experts.lora_A)."""
    module = name.rsplit(".", 1)[0]
    later = len(wrapped) - 1 - wrapped.index(name)
    return module + ".base_layer" * later


def _experts_a(a):
    """tfllm A (E, in, r) -> peft lora_A (E r, in)."""
    e, d, r = a.shape
    return a.transpose(0, 2, 1).reshape(e * r, d)


def _experts_b(*bs):
    """tfllm Bs (r, E, out_j) -> peft lora_B (sum out_j, r E), the paths' rows stacked."""
    return np.concatenate([b.reshape(-1, b.shape[-1]).T for b in bs], axis=0)


def _experts_a_in(a, r: int):
    """peft lora_A (E r, in) -> tfllm's A (E, in, r) flattened to (E in, r)."""
    e = a.shape[0] // r
    return a.reshape(e, r, -1).transpose(0, 2, 1).reshape(-1, r)


def _experts_b_in(b, r: int):
    """peft lora_B rows (out, r E) -> tfllm's B (r, E, out) flattened to (r, E out)."""
    out, e = b.shape[0], b.shape[1] // r
    return b.reshape(out, r, e).transpose(1, 2, 0).reshape(r, e * out)


def _dims(m):
    h = m.num_query_heads
    kv = m.num_key_value_heads or h
    hd = m.head_dim or m.hidden_dim // h
    return m.hidden_dim, h * hd, kv * hd, m.intermediate_dim


def _in_size(m, path, experts: bool = False) -> int:
    """The input size of projection `path` (an expert's, with `experts`)."""
    e, q, _, f = _dims(m)
    if experts:
        f = m.moe_intermediate_dim or f
    return {"attention/output": q, "mlp/down": f}.get(path, e)


def _out_size(m, path, experts: bool = False) -> int:
    """The output size of projection `path` (an expert's, with `experts`)."""
    e, q, kv, f = _dims(m)
    if experts:
        f = m.moe_intermediate_dim or f
    return {"attention/query": q, "attention/key": kv, "attention/value": kv,
            "mlp/gate": f, "mlp/up": f}.get(path, e)


def vllm_refusal(family: Family, lora, m) -> Optional[str]:
    """Why vLLM would refuse or silently ignore this adapter of `family` on model section
    `m`, or None."""
    if family.lora.vllm_refusal:
        return family.lora.vllm_refusal
    experts = sorted({x.name for layer in targeted(m, lora) for x in layer if x.experts})
    if experts:
        # vLLM reads peft's (E r, in) / (out, r E) expert tensors with another layout or
        # drops them (vllm-project/vllm#41384 and #52194, both unmerged)
        return (f"vLLM does not serve peft's target_parameters adapters of fused experts "
                f"({', '.join(experts)}): export merged weights (--format hf --merge-lora)")
    if lora.rank not in VLLM_RANKS:
        return (f"lora.rank={lora.rank} is not a rank vLLM serves (--max-lora-rank takes "
                f"{', '.join(map(str, VLLM_RANKS))}): train with one of them")
    return None


def peft_refusal(m, family: Family, lora) -> Optional[str]:
    """What of this adapter peft cannot load onto `family`'s transformers model, or None.

    peft (0.19+, with transformers 5) reads the MLP names gate_proj / up_proj / down_proj
    of a mixture of experts' adapter as the experts' of transformers 4 and rewrites them
    into target_parameters (`convert_peft_config_for_transformers`): LoRA on the dense
    layers of a Qwen3-MoE (model.mlp_only_layers) has no peft form."""
    if not m.num_experts:
        return None
    expert_paths = {p for ps in family.lora.experts.values() for p in ps}
    dense = [x.name for x in dict.fromkeys(x for layer in targeted(m, lora) for x in layer)
             if not x.experts and set(x.paths) & expert_paths]
    if not dense:
        return None
    return (f"peft cannot load LoRA on the dense layers' MLP of a {family.model_type} model "
            f"({', '.join(dense)}): it reads those names as the experts' (transformers 4's) "
            "and adapts the experts instead; export merged weights (--format hf "
            "--merge-lora), or train with lora.targets without them")


def adapter_config(m, family: Family, lora, patterns: dict, base: Optional[str]) -> dict:
    """adapter_config.json of the run's adapters (see the module docstring) on model
    section `m`."""
    used = [x for layer in targeted(m, lora) for x in layer]
    modules = [n for n in family.lora.modules if any(x.name == n for x in used)]
    experts = [n for n in family.lora.experts if any(x.name == n for x in used)]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
        "lora_alpha": lora.alpha, "use_rslora": bool(lora.rslora),
        "lora_dropout": float(lora.dropout),
        # peft refuses an empty target_modules list: None with expert parameters only
        "target_modules": _target_names(family.lora, modules) or None,
        "target_parameters": experts or None,
        "bias": "none", "use_dora": False, "modules_to_save": None,
        "fan_in_fan_out": family.lora.fan_in_fan_out, "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": base,
        "layers_to_transform": None, "layers_pattern": None, "revision": None, **patterns,
    }


# ---- merged weights (--format hf --merge-lora) -------------------------------------------
def merged(reader, prefix: str, source: str, array: np.ndarray, lora, m) -> np.ndarray:
    """A kernel with its adapter merged, W + s A B, in float32 (tfllm's layout); an
    expert kernel (E, in, out) per expert, W_e + s A_e B_e, its A the one its expert
    parameter shares (up takes gate's); `m` is the run's model section."""
    if not source.endswith("/kernel"):
        return array
    layer = prefix + source[: -len("kernel")]
    if layer + "lora_b" not in reader.variables:
        return array
    b = reader.whole(layer + "lora_b").astype(np.float32)
    b_path = source[: -len("kernel")] + "lora_b"  # block_i/mlp/up/lora_b
    a = reader.whole(prefix + a_source(m, b_path)).astype(np.float32)
    s = np.float32(scale(lora))
    if expert_adapter(m, b_path):  # A (E, in, r), B (r, E, out)
        return array.astype(np.float32) + s * np.einsum("eir,reo->eio", a, b)
    return array.astype(np.float32) + s * np.tensordot(a, b, axes=1)


# ---- adapters in (tfllm import --adapter) -------------------------------------------------
#: the largest adapter_config.json read (peft writes about 1 KB)
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
#: rank_pattern / alpha_pattern: what a value must be, and what it is called
_PATTERNS = (("rank_pattern", "a whole number of at least 1"),
             ("alpha_pattern", "a finite number above 0"))


def _whole(value) -> bool:
    return type(value) is int and value >= 1


def _positive(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


def _no_constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def _read_config(path: str, config_path: str) -> dict:
    """adapter_config.json as a dict with every field tfllm reads typed; one line else."""
    from tfllm.confined import read_regular
    fix = "give the folder peft's save_pretrained wrote"
    try:
        data = read_regular(config_path, MAX_ADAPTER_CONFIG_BYTES, "an adapter_config.json",
                            PretrainedError, fix)
    except FileNotFoundError:
        raise PretrainedError(f"--adapter {path}: no {ADAPTER_CONFIG}; {fix}.") from None
    try:
        c = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise PretrainedError(f"{config_path}: JSON nested too deep; {fix}.") from None
    except ValueError as e:  # a JSONDecodeError, invalid UTF-8, NaN, a 5000-digit number
        text = " ".join(str(e).split())[:120]
        raise PretrainedError(f"{config_path}: not JSON ({text}); {fix}.") from None
    if not isinstance(c, dict):
        raise PretrainedError(f"{config_path}: a JSON {type(c).__name__}, not an object; "
                              f"{fix}.")
    if c.get("peft_type") != "LORA":
        raise PretrainedError(f"{config_path}: peft_type is {str(c.get('peft_type'))[:40]!r}; "
                              "only LORA adapters are read.")
    for key, ok, fix_key in (
            ("use_dora", lambda v: not v, "DoRA is not supported"),
            ("modules_to_save", lambda v: not v,
             "whole modules saved beside the adapter are not supported"),
            ("bias", lambda v: v in (None, "none"), "adapter biases are not supported"),
            ("layers_to_transform", lambda v: v is None,
             "adapters on some layers only are not supported"),
            ("target_modules", lambda v: isinstance(v, list) and v and all(
                isinstance(t, str) for t in v),
             "a regular expression of modules is not supported: list the module names "
             "(strings)"),
            ("r", _whole, "the rank must be a whole number of at least 1"),
            ("lora_alpha", lambda v: v is None or _positive(v),
             "lora_alpha must be a finite number above 0"),
            ("use_rslora", lambda v: v in (None, True, False), "use_rslora must be true or "
             "false"),
            ("lora_dropout", lambda v: v is None or (type(v) in (int, float) and 0 <= v < 1),
             "lora_dropout must be a number from 0 to below 1")):
        if not ok(c.get(key)):
            raise PretrainedError(f"{config_path}: {key}={str(c.get(key))[:60]}: {fix_key}.")
    for key, what in _PATTERNS:
        pattern = c.get(key) or {}
        check = _whole if key == "rank_pattern" else _positive
        if not isinstance(pattern, dict) or not all(
                isinstance(k, str) and check(v) for k, v in pattern.items()):
            raise PretrainedError(f"{config_path}: {key}={str(c.get(key))[:60]}: must map "
                                  f"module names to {what}.")
    return c


def _load_weights(path: str) -> Dict[str, np.ndarray]:
    """The adapter's tensors: a regular file safetensors reads; every tensor a finite
    floating-point matrix. One line naming the file and the tensor otherwise."""
    from tfllm.confined import open_regular
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    try:
        open_regular(weights_path, None, "a safetensors adapter", PretrainedError).close()
    except FileNotFoundError:
        raise PretrainedError(f"--adapter {path}: no {ADAPTER_WEIGHTS} (tfllm reads "
                              "safetensors adapters).") from None
    try:
        stored = _safetensors(weights_path)
    except Exception as e:  # noqa: BLE001 (safetensors' own error, truncation, dtype)
        text = " ".join(str(e).split())[:160]
        raise PretrainedError(f"{weights_path}: not a readable safetensors file ({text}); "
                              "save the adapter again with peft's save_pretrained.") from None
    for key, array in stored.items():
        if array.dtype.kind != "f" or array.ndim != 2:
            raise PretrainedError(f"{weights_path}: {key} is {array.dtype} of shape "
                                  f"{list(array.shape)}, not a floating-point matrix as peft "
                                  "writes.")
        if not np.isfinite(array).all():
            bad = int(np.size(array) - np.isfinite(array).sum())
            raise PretrainedError(f"{weights_path}: {key} holds {bad} NaN or infinite "
                                  "values; the adapter is broken (retrain or re-save it).")
    return stored


def _safetensors(path: str) -> Dict[str, np.ndarray]:
    """The tensors of a safetensors file as numpy arrays, bfloat16 ones as float32 (numpy
    has no bfloat16: peft saves a bfloat16 model's adapter so, and so does `tfllm export
    --format peft --dtype bfloat16`). safetensors validates the header (its size, every
    tensor's offsets inside the file) when the file is opened, before anything is read."""
    from safetensors import safe_open
    out = {}
    with safe_open(path, framework="numpy") as f:
        bf16 = [k for k in f.keys() if f.get_slice(k).get_dtype() == "BF16"]
        out.update({k: f.get_tensor(k) for k in f.keys() if k not in bf16})
    if bf16:
        from tfllm.confined import open_regular
        with open_regular(path, None, "a safetensors adapter", PretrainedError) as raw:
            size = struct.unpack("<Q", raw.read(8))[0]
            header = json.loads(raw.read(size))
            for k in bf16:
                start, end = header[k]["data_offsets"]
                raw.seek(8 + size + start)
                bits = np.frombuffer(raw.read(end - start), "<u2").astype(np.uint32) << 16
                out[k] = bits.view(np.float32).reshape(header[k]["shape"])
    return out


def read_adapter(path: str, family: str) -> Tuple[dict, Dict[str, np.ndarray]]:
    """The lora settings and tfllm's A/B arrays ({"block_i/<proj>/lora_a": array}) of a
    peft adapter folder, for a base model of `family`.

    Everything is checked before it is used, one PretrainedError line otherwise:
    adapter_config.json's fields and types, every tensor a finite float matrix, lora_A
    (r, in) and lora_B (out, r) exactly as peft writes them, with the rank of
    adapter_config.json or of its `rank_pattern` (a wrong orientation is refused, never
    reshaped), one rank and alpha for all modules (`rank_pattern`/`alpha_pattern` are
    honoured where they say the same or are GPT-2's fused c_attn export, else refused),
    and no tensor the config does not name. `check_adapter_shapes` then compares in and
    out with the base model.
    """
    config_path = os.path.join(path, ADAPTER_CONFIG)
    c = _read_config(path, config_path)
    r = c["r"]
    alpha = float(c["lora_alpha"]) if c.get("lora_alpha") is not None else 8.0  # peft's
    rslora = bool(c.get("use_rslora"))
    names = lora_names(family)
    modules = {}
    for field, table in (("target_modules", names.modules),
                         ("target_parameters", names.experts)):
        for t in c.get(field) or []:
            hit = [m for m in table if matches(m, t)]
            if not hit:
                raise PretrainedError(f"{config_path}: {field} names {t[:60]!r}, which is no "
                                      f"{'projection' if table is names.modules else 'expert parameter'}"
                                      f" tfllm's {family} family has ({sorted(table)}).")
            modules.update({m: table[m] for m in hit})
    experts = [m for m in names.experts if m in modules]  # peft's nesting order
    ranks, alphas = c.get("rank_pattern") or {}, c.get("alpha_pattern") or {}
    _check_patterns(config_path, {m: p for m, p in modules.items() if m not in experts},
                    r, alpha, rslora, ranks, alphas)
    for key, pattern in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        for name in experts:
            value = pattern.get(name, pattern.get(name.rsplit(".", 1)[-1]))
            if value is not None and value != (r if key == "rank_pattern" else alpha):
                raise PretrainedError(f"{config_path}: {key} gives {name} {value}: tfllm "
                                      "trains one rank and alpha for every module; export "
                                      "the adapter with one r and lora_alpha.")
    stored = _load_weights(path)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    arrays, used = {}, set()
    layer = names.layer_prefix
    numbered = re.compile(re.escape(_PEFT_PREFIX + layer).replace(r"\{i\}", r"(\d+)"))
    indices = {int(hit.group(1)) for hit in map(numbered.match, stored) if hit}
    mlp = {p for paths in names.experts.values() for p in paths}
    for i in range(max(indices) + 1 if indices else 0):
        # A mixture of experts' dense layers have the MLP's modules, its sparse ones the
        # expert parameters: which a layer has shows in its keys (the model then holds
        # every layer to its kind: `tfllm.pretrained.importer.load_adapter`).
        has_experts = [m for m in experts
                       if _PEFT_PREFIX + layer.format(i=i) + _expert_module(m, experts)
                       + ".lora_A.weight" in stored]
        for module, paths in modules.items():
            if module in experts:
                if has_experts:
                    _read_experts(stored, weights_path, i, module, paths, experts, r, arrays,
                                  used, layer)
                continue
            key = _PEFT_PREFIX + layer.format(i=i) + module
            if set(paths) & mlp and not any(k.startswith(key + ".") for k in stored):
                continue  # the dense MLP's module, which a sparse layer has not
            a, b = _lora_pair(stored, weights_path, key, used)
            leaf = module.rsplit(".", 1)[-1]
            rank = ranks.get(leaf, ranks.get(module, r))
            for name, array, axis, form in (("lora_A", a, 0, "(r, in)"),
                                            ("lora_B", b, 1, "(out, r)")):
                if array.shape[axis] != rank:
                    raise PretrainedError(
                        f"{weights_path}: {key}.{name}.weight is {list(array.shape)}, but "
                        f"peft writes {name} as {form} with r = {rank} "
                        f"(adapter_config.json); a transposed or other-rank tensor is "
                        "refused, never reshaped.")
            a, b = a.astype(np.float32), b.astype(np.float32)
            if len(paths) > 1 and rank == r * len(paths):  # tfllm's own block form
                if b.shape[0] % len(paths):
                    raise PretrainedError(f"{weights_path}: {key}.lora_B.weight has "
                                          f"{b.shape[0]} rows, not {len(paths)} equal blocks.")
                rows = np.cumsum([0] + [b.shape[0] // len(paths)] * len(paths))
                for k, p in enumerate(paths):
                    block = b[rows[k]:rows[k + 1]]
                    off = np.delete(block, np.s_[k * r:(k + 1) * r], axis=1)
                    if np.any(off):
                        raise PretrainedError(f"{weights_path}: {key} has rank "
                                              f"{rank} that is not {len(paths)} separate "
                                              f"rank-{r} adapters; tfllm needs one rank.")
                    arrays[f"block_{i}/{p}/lora_a"] = a[k * r:(k + 1) * r].T
                    arrays[f"block_{i}/{p}/lora_b"] = block[:, k * r:(k + 1) * r].T
                continue
            if b.shape[0] % len(paths):
                raise PretrainedError(f"{weights_path}: {key}.lora_B.weight has "
                                      f"{b.shape[0]} rows, not {len(paths)} equal blocks.")
            rows = np.cumsum([0] + [b.shape[0] // len(paths)] * len(paths))
            for k, p in enumerate(paths):  # GPT-2's c_attn: q, k, v share peft's A
                arrays[f"block_{i}/{p}/lora_a"] = a.T
                arrays[f"block_{i}/{p}/lora_b"] = b[rows[k]:rows[k + 1]].T
    extra = sorted(set(stored) - used)
    per_expert = [k for k in extra if re.search(r"\.experts\.\d+\.", k)]
    if per_expert:
        raise PretrainedError(f"{weights_path}: {per_expert[0]} is an adapter of one expert "
                              "(transformers 4's per-expert modules, gate and up each with "
                              "its own A): tfllm trains peft's target_parameters form (per "
                              "expert one A shared by gate and up, one rank), so it cannot "
                              "hold it; merge the adapter into the model with peft "
                              "(merge_and_unload) and import the merged folder.")
    if extra:
        raise PretrainedError(f"{weights_path}: holds {len(extra)} tensor(s) its "
                              f"adapter_config.json does not name ({extra[0]}, ...): not an "
                              f"adapter of the {family} modules it lists; give a matching "
                              "adapter_config.json.")
    if not arrays:
        raise PretrainedError(f"{weights_path}: holds no adapter tensor of a layer "
                              f"({_PEFT_PREFIX}{layer.format(i=0)}...).")
    settings = {"lora.rank": r, "lora.alpha": alpha, "lora.rslora": rslora,
                "lora.dropout": float(c.get("lora_dropout") or 0.0),
                "lora.targets": list(modules)}
    return settings, arrays


def _lora_pair(stored, weights_path, key: str, used: set):
    """(lora_A, lora_B) of peft's module `key`, marked used; a missing one is refused
    naming it."""
    try:
        a, b = stored[key + ".lora_A.weight"], stored[key + ".lora_B.weight"]
    except KeyError as e:
        raise PretrainedError(f"{weights_path}: holds no {e.args[0]}; the adapter does not "
                              "match its adapter_config.json.") from None
    used.update((key + ".lora_A.weight", key + ".lora_B.weight"))
    return a, b


def _read_experts(stored, weights_path, i, module, paths, experts, r, arrays, used,
                  layer) -> None:
    """One expert parameter's lora_A (E r, in) and lora_B (out, r E) of layer i into
    tfllm's A of its first path and a B per path (`arrays`, flattened as `load_adapter`
    takes them)."""
    key = _PEFT_PREFIX + layer.format(i=i) + _expert_module(module, experts)
    a, b = _lora_pair(stored, weights_path, key, used)
    if a.shape[0] % r or b.shape[1] != a.shape[0] or b.shape[0] % len(paths):
        raise PretrainedError(f"{weights_path}: {key}.lora_A.weight is {list(a.shape)} and "
                              f"lora_B.weight {list(b.shape)}, but peft writes an expert "
                              f"parameter's as (E r, in) and (out, r E) with r = {r} "
                              "(adapter_config.json); a transposed or other-rank tensor is "
                              "refused, never reshaped.")
    a, b = a.astype(np.float32), b.astype(np.float32)
    arrays[f"block_{i}/{paths[0]}/lora_a"] = _experts_a_in(a, r)
    rows = b.shape[0] // len(paths)
    for k, p in enumerate(paths):  # gate_up_proj: the gate's rows, then the up's
        arrays[f"block_{i}/{p}/lora_b"] = _experts_b_in(b[k * rows:(k + 1) * rows], r)


def _check_patterns(config_path, modules, r, alpha, rslora, ranks, alphas) -> None:
    """rank_pattern / alpha_pattern: honoured where they say what tfllm trains (the
    config's rank and alpha, or GPT-2's fused c_attn as tfllm exports it: rank k r with
    the same scale); any other key or value is refused (tfllm trains one rank and alpha
    for every module), naming the key."""
    names = {}
    for module, paths in modules.items():
        names[module] = names[module.rsplit(".", 1)[-1]] = len(paths)
    for key, pattern, own in (("rank_pattern", ranks, r), ("alpha_pattern", alphas, alpha)):
        for name, value in pattern.items():
            n = names.get(name)
            fused = n is not None and n > 1 and (
                value == r * n if key == "rank_pattern" else
                math.isclose(value, alpha * (math.sqrt(n) if rslora else n)))
            if value != own and not fused:
                raise PretrainedError(
                    f"{config_path}: {key} gives {name[:60]!r} {value}, where the adapter's "
                    f"is {own}: tfllm trains one rank and alpha for every module; export "
                    "the adapter with one r and lora_alpha.")
    for module, n in ((m, len(p)) for m, p in modules.items() if len(p) > 1):
        leaf = module.rsplit(".", 1)[-1]
        rank = ranks.get(leaf, ranks.get(module, r))
        scaled = alphas.get(leaf, alphas.get(module, alpha))
        if (rank == r * n) != (scaled != alpha):
            raise PretrainedError(f"{config_path}: rank_pattern and alpha_pattern of {leaf} "
                                  "do not keep one scale for all modules.")


def check_adapter_shapes(arrays: Dict[str, np.ndarray], m, family: str,
                         where: str = "--adapter") -> None:
    """Each imported A (in, r) and B (r, out) (tfllm's orientation of peft's lora_A
    (r, in) and lora_B (out, r)) has exactly the in and out sizes of its projection in
    model config `m`: an adapter of another base is refused before anything is built."""
    for name, array in arrays.items():
        path = name.split("/", 1)[1].rsplit("/", 1)[0]  # attention/query
        is_a = name.endswith("/lora_a")
        experts = expert_adapter(m, name)
        want = _in_size(m, path, experts) if is_a else _out_size(m, path, experts)
        want *= m.num_experts if experts else 1  # (E in, r) and (r, E out)
        have = array.shape[0] if is_a else array.shape[1]
        if have != want:
            peft_name = "lora_A (r, in)" if is_a else "lora_B (out, r)"
            raise PretrainedError(
                f"{where}: {name} has {'in' if is_a else 'out'} = {have} where the model's "
                f"{path} has {want} (peft's {peft_name} is {list(array.shape[::-1])}); is it "
                "an adapter of this base?")
