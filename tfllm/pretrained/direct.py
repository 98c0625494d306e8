"""Hugging Face folders tfllm reads itself: the families with `Family.tensors_in`.

For the mixtures of experts (`tfllm.families.moe_layout` says why keras-hub's converters
cannot be driven), each tfllm variable is assembled from the folder's tensors that name
it in the family's `Tensor` list, the list export writes with. A `Tensor`'s `make` only
moves values (transposes, reshapes, selections, concatenations), so applying it to the
variables' element indices says where each stored value goes: the import is the export
run backwards, element by element, and a variable any of whose elements no tensor
fills, or fills twice, is an error. A client reads whole tensors, one at a time, as the
keras-hub path does (peak host memory: one variable and one stored tensor).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import numpy as np

from tfllm import internals
from tfllm.confined import read_regular
from tfllm.families import Family, PretrainedError, Tensor
from tfllm.parallel.placement import block_slices
from tfllm.pretrained.sources import (HF_INDEX, HF_WEIGHTS, Source, _file_names,
                                      check_computation_keys, open_source,
                                      transformers4_rope)

#: the most config.json may hold
MAX_CONFIG_BYTES = 16 << 20


def direct_family(path: str) -> Optional[Family]:
    """The family of the Hugging Face folder `path` when tfllm reads it itself, else None
    (keras-hub presets and the families keras-hub converts)."""
    from tfllm.families import FAMILIES
    try:
        raw = read_regular(os.path.join(path, "config.json"), MAX_CONFIG_BYTES,
                           "config.json", PretrainedError)
        model_type = json.loads(raw).get("model_type")
    except (ValueError, AttributeError):
        return None  # keras-hub's loader says what is wrong with it
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    return family if family is not None and family.tensors_in is not None else None


def open_preset(path: str) -> Source:
    """The `Source` of a keras-hub preset or Hugging Face folder: a `DirectSource` for the
    families tfllm reads itself, else `open_source`'s (whose checks and errors apply)."""
    path = os.path.abspath(os.path.expanduser(path))
    config = os.path.join(path, "config.json")
    family = direct_family(path) if os.path.isfile(config) else None
    return DirectSource(path, family) if family is not None else open_source(path)


class DirectSource(Source):
    """A Hugging Face folder of a `tensors_in` family; its variables are tfllm's own paths
    (`weight_map` is the identity)."""

    format = "huggingface"
    keras_hub = None  # no keras-hub backbone: `config_in` reads config.json

    def __init__(self, path: str, family: Family):  # noqa: D107 (Source's attributes)
        self.path, self.loader, self.family = path, None, family
        raw = read_regular(self.file("config.json", path), MAX_CONFIG_BYTES, "config.json",
                           PretrainedError)
        self.hf_config = json.loads(raw)
        check_computation_keys(self.hf_config, path)
        self.config, self.stated = {}, set()
        self.backbone = family.architecture
        self.backbone_cls = None
        self._reader = None
        self._plan: Dict[str, List[Tensor]] = {}
        self._abstract = None
        self._keys = self.stored()

    def weight_map(self, m) -> Dict[str, str]:
        """{tfllm path: tfllm path} of every variable the folder's tensors fill; a tensor of
        the folder that fills none, or one the family needs but the folder lacks, is an
        error."""
        tensors = self.family.tensors_in(m, self._keys)
        missing = sorted({t.key for t in tensors} - set(self._keys))
        if missing:
            raise PretrainedError(f"{self.path}: no tensor {missing[:3]} ({len(missing)} "
                                  "missing); the safetensors files do not match "
                                  "config.json.")
        unused = sorted(set(self._keys) - {t.key for t in tensors})
        if unused:
            raise PretrainedError(f"{self.path}: the tensors {unused[:3]} have no place in "
                                  f"tfllm's model of this config.json ({self.backbone}); "
                                  "check the --set model.* overrides.")
        self._plan = {}
        for t in tensors:
            for s in t.sources:
                self._plan.setdefault(s, []).append(t)
        return {p: p for p in self._plan}

    @property
    def variables(self):
        return {p: None for p in self._plan}

    def describe(self, name: str) -> str:
        keys = [t.key for t in self._plan.get(name, ())]
        shown = keys[0] if len(keys) == 1 else f"{keys[0]} .. ({len(keys)} tensors)"
        return f"{self.path} [{shown}] ({name})"

    def read(self, name, blocks, shape):
        full = self._assemble(name, tuple(shape))
        return {block: full[block_slices(*block)] if len(shape) else full
                for block in blocks}

    def _assemble(self, name: str, shape) -> np.ndarray:
        size = int(np.prod(shape))
        out, filled = None, np.zeros(size, np.int32)
        for t in self._plan[name]:
            # Each source's element indices, offset by its position among the sources:
            # `make` places them where it places the values.
            where = t.make(*[np.arange(size).reshape(shape) + i * size
                             for i in range(len(t.sources))])
            stored = self._tensor(t, name)
            mine = (where // size) == t.sources.index(name)
            target = (where % size)[mine]
            if out is None:
                out = np.zeros(size, stored.dtype)
            out[target] = stored[mine]
            np.add.at(filled, target, 1)
        if not (filled == 1).all():
            raise PretrainedError(f"{self.describe(name)}: {int((filled != 1).sum())} of "
                                  f"{size} elements are not filled exactly once; the family's "
                                  "tensor list is inconsistent.")
        return out.reshape(shape)

    def _tensor(self, t: Tensor, name: str) -> np.ndarray:
        if self._reader is None:
            self._reader = internals.recording_safetensor_loader(self.path)
            self._reader.__enter__()
        try:
            tensor = self._reader.get_tensor(t.key)
        except Exception as e:  # safetensors raises its own error types
            raise PretrainedError(f"{self.path}: tensor {t.key} ({name}) cannot be read: "
                                  f"{e}") from None
        self._check(name, tensor.shape, tensor.dtype, t.shape)
        return np.asarray(tensor)

    def stored(self) -> List[str]:
        from safetensors import safe_open
        names = []
        if os.path.exists(os.path.join(self.path, HF_INDEX)):
            files = sorted(set(_file_names(self._weight_map(HF_INDEX))))
        else:
            files = [HF_WEIGHTS]
        for fname in files:
            with safe_open(self.file(fname, self.path), framework="np") as f:
                names.extend(f.keys())
        return names

    @property
    def abstract(self):
        """keras-hub's backbone of the model_type, shapes only: the tokenizer preset a run
        keeps names it (Tokenizer.from_preset finds its class through it)."""
        if self._abstract is None:
            converter = internals.preset_loader(self.path).converter
            config = transformers4_rope(dict(self.hf_config), self.path)
            # keras-hub 0.32's Qwen3-MoE converter reads transformers 4's name
            config.setdefault("num_experts", config.get("num_local_experts"))
            self._abstract = internals.abstract_backbone(
                converter.backbone_cls,
                {**converter.convert_backbone_config(config), "dtype": "float32"})
        return self._abstract

    def close(self):
        if self._reader is not None:
            self._reader.__exit__(None, None, None)
            self._reader = None
