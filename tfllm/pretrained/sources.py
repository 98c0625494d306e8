"""Reading pretrained weights tensor by tensor: keras-hub presets and Hugging Face folders.

`open_source(dir)` recognizes the folder the way keras-hub does (its `config.json` is a
serialized Keras backbone, or a Transformers config with a `model_type`) and returns a
`Source` whose tensors are addressed by keras-hub variable paths
("transformer_layer_0/self_attention/query/kernel") in keras-hub's shapes.

* keras-hub presets: `model.weights.h5` (or the sharded `model.weights.json` + shards)
  is read with h5py block by block: a client reads only the slices its devices hold.
* Hugging Face folders: keras-hub's own converter for the `model_type` says which
  safetensors tensor feeds each variable and how it is transposed/reshaped; that
  reshaping needs the whole tensor, so a client reads one whole tensor at a time
  (peak host memory: the largest tensor, not the model).
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tfllm.confined import inside, read_regular
from tfllm.parallel.placement import block_slices
from tfllm import internals
from tfllm.families import (FAMILIES, PretrainedError, backbone_for, family_of_backbone,
                            supported)
from tfllm.families.base import REFUSED_EVERYWHERE

Block = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (start, size)

#: source dtypes a float32 tfllm weight may be read from (all convert exactly or widen)
FLOAT_DTYPES = ("float16", "bfloat16", "float32")

KERAS_WEIGHTS = "model.weights.h5"
KERAS_SHARDED = "model.weights.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
_UNTRUSTED = "the preset was made by a buggy or malicious program: do not import it"

#: the most a weight-map index (model.safetensors.index.json) may hold: Llama 3.1 405B's
#: is ~100 KB
MAX_INDEX_BYTES = 64 << 20


def hf_cache_repository(path: str):
    """The cache repository of a Hugging Face cache snapshot folder, else None.

    `huggingface_hub` keeps a download as `models--ORG--NAME/snapshots/REVISION/` whose
    files are links to `models--ORG--NAME/blobs/HASH`; such a folder's links may lead
    anywhere inside its repository, nowhere else.
    """
    snapshots = os.path.dirname(os.path.realpath(path))
    repository = os.path.dirname(snapshots)
    if (os.path.basename(snapshots) == "snapshots"
            and os.path.basename(repository).startswith("models--")
            and os.path.isdir(os.path.join(repository, "blobs"))):
        return repository
    return None


def _file_names(weight_map: dict) -> list:
    """Every file name a weight map's values hold (each a name or a list of names)."""
    return [n for v in weight_map.values() for n in (v if isinstance(v, list) else [v])]


class Source:
    """A pretrained model folder: its keras-hub backbone class, config and tensors.

    Attributes:
      path: the folder.
      format: "keras-hub" or "huggingface".
      backbone: the keras-hub backbone class name (e.g. "Llama3Backbone").
      backbone_cls: that class.
      keras_hub: tfllm's mapping of that backbone (`tfllm.families.Backbone`).
      family: the family holding it (`tfllm.families.Family`).
      config: the keras-hub backbone config (constructor arguments).
      hf_config: the Transformers config.json (Hugging Face folders), else None.
      variables: {keras-hub variable path: shape} of the backbone.
    """

    format = ""

    def __init__(self, path: str, loader):
        self.path = path
        self.loader = loader
        self.hf_config: Optional[dict] = None
        self.backbone_cls, config = self._backbone()
        # Arguments the config leaves out take the backbone's defaults, as keras-hub does.
        defaults = {k: p.default for k, p in
                    inspect.signature(self.backbone_cls.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty and k != "dtype"}
        self.config = {**defaults, **config}
        self.stated = set(config)  # the keys the folder's config really names
        self.backbone = self.backbone_cls.__name__
        where = os.path.join(path, "config.json")
        self.keras_hub = backbone_for(self.backbone, where)
        self.family = family_of_backbone(self.backbone, where)
        self._abstract = None

    # Reading the configs touches no TensorFlow device; building the abstract backbone
    # may, so it waits until the mesh (which splits the CPU into devices) exists.
    @property
    def abstract(self):
        """The keras-hub backbone with shapes and paths only (no memory)."""
        if self._abstract is None:
            self._abstract = internals.abstract_backbone(
                self.backbone_cls, {**self.config, "dtype": "float32"})
            self._prepare()
        return self._abstract

    @property
    def variables(self) -> Dict[str, Tuple[int, ...]]:
        """{keras-hub variable name (`Backbone.variable_name`): shape} of the backbone's
        weights."""
        return {self.keras_hub.variable_name(v.path): tuple(int(n) for n in v.shape)
                for v in self.abstract.variables
                if "seed_generator" not in v.path}  # dropout RNG state, not a weight

    def _prepare(self) -> None:
        """Format-specific indexing once the abstract backbone exists."""

    def weight_map(self, m) -> Dict[str, object]:
        """{tfllm path: this source's variable name (or a `Permuted`)} for model section
        `m`: keras-hub's backbone's (`Backbone.weight_map`)."""
        return self.keras_hub.weight_map(m)

    def file(self, name, what: str) -> str:
        """The path of the folder's file `name` (named by `what`, e.g. a weight map): a plain
        file name whose resolved path, symlinks followed, is inside the folder."""
        return inside(self.path, name, what, PretrainedError, flat=True, fix=_UNTRUSTED,
                      root=hf_cache_repository(self.path))

    def _weight_map(self, index: str) -> dict:
        """The "weight_map" of the folder's JSON file `index` ({tensor or group: file name
        or list of them}), every file name checked by `file` before any is opened (a
        weight map is written by whoever made the preset)."""
        what = f"{self.path}/{index}"
        try:  # a regular file of a bounded size (a FIFO or /dev/zero is one line)
            raw = read_regular(self.file(index, what), MAX_INDEX_BYTES, "a weight map index",
                               PretrainedError, _UNTRUSTED)
            weight_map = dict(json.loads(raw)["weight_map"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise PretrainedError(f"{what}: not a weight map ({type(e).__name__}: {e}); it "
                                  "must be JSON with a \"weight_map\" object of tensor -> file "
                                  "name.") from None
        for name in _file_names(weight_map):
            self.file(name, what)
        return weight_map

    def _backbone(self):
        raise NotImplementedError

    def describe(self, name: str) -> str:
        """Where the tensor feeding keras-hub variable `name` lives (for messages)."""
        raise NotImplementedError

    def read(self, name: str, blocks: Sequence[Block], shape: Tuple[int, ...]
             ) -> Dict[Block, np.ndarray]:
        """The `blocks` of keras-hub variable `name`, checked against `shape` and dtype."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _check(self, name: str, got_shape, got_dtype, shape) -> None:
        if tuple(got_shape) != tuple(shape):
            raise PretrainedError(f"{self.describe(name)}: shape {list(got_shape)}, but the "
                                  f"model config needs {list(shape)}; the weights do not "
                                  "belong to this config.json (or a --set changed the model).")
        if str(got_dtype) not in FLOAT_DTYPES:
            raise PretrainedError(f"{self.describe(name)}: dtype {got_dtype}; tfllm reads "
                                  f"{', '.join(FLOAT_DTYPES)} weights (quantized checkpoints "
                                  "are not supported).")


class KerasPresetSource(Source):
    """A keras-hub preset directory (`save_to_preset`)."""

    format = "keras-hub"

    def __init__(self, path: str, loader):
        import h5py
        super().__init__(path, loader)
        self._h5py = h5py
        self.locations: Dict[str, str] = {}
        self._files: Dict[str, object] = {}
        single = os.path.join(path, KERAS_WEIGHTS)
        sharded = os.path.join(path, KERAS_SHARDED)
        if os.path.exists(single):
            self.file(KERAS_WEIGHTS, path)  # not a link out of the folder
            self._map = None
        elif os.path.exists(sharded):
            self._map = self._weight_map(KERAS_SHARDED)
        else:
            raise PretrainedError(f"{path}: a keras-hub preset needs {KERAS_WEIGHTS} (or the "
                                  f"sharded {KERAS_SHARDED}); neither exists. Save the model "
                                  "with save_to_preset, or copy its weights file here.")

    def _prepare(self):
        self.locations = {self.keras_hub.variable_name(path): dataset for path, dataset in
                          internals.h5_locations(self._abstract).items()}

    def stores_output_embedding(self) -> bool:
        """Whether the weights hold a separate output embedding (a ReversibleEmbedding's
        second variable). keras-hub's Llama configs (0.32) omit tie_word_embeddings, so a
        tied preset is recognized by its weights."""
        found = []
        for fname in self._weight_files():
            self._open(fname).visit(lambda n: found.append(n) if n.endswith(
                "reversible_embedding/vars/1") else None)
        return bool(found)

    def _weight_files(self) -> List[str]:
        if self._map is None:
            return [KERAS_WEIGHTS]
        return sorted(set(_file_names(self._map)))

    def _backbone(self):
        import keras_hub
        config = self.loader.config
        name = config.get("class_name", "")
        cls = getattr(keras_hub.models, name, None)
        if cls is None:
            raise PretrainedError(f"{self.path}/config.json: class {name!r} is not a keras-hub "
                                  "model class.")
        return cls, dict(config.get("config", {}))

    def _file_for(self, dataset: str) -> str:
        if self._map is None:
            return KERAS_WEIGHTS
        group = "/" + dataset.rsplit("/", 1)[0]
        files = self._map.get(group)
        if files is None:
            raise PretrainedError(f"{self.path}/{KERAS_SHARDED}: no shard holds {group}; the "
                                  "sharded preset is incomplete.")
        files = files if isinstance(files, list) else [files]
        for fname in files:
            if dataset in self._open(fname):
                return fname
        raise PretrainedError(f"{self.path}: {dataset} is in none of {files}.")

    def _open(self, fname: str):
        if fname not in self._files:
            full = self.file(fname, f"{self.path}/{KERAS_SHARDED}" if self._map is not None
                             else self.path)
            if not os.path.exists(full):
                raise PretrainedError(f"{full}: missing; the preset names it but it is not "
                                      "there (an incomplete download?).")
            self._files[fname] = self._h5py.File(full, "r")
        return self._files[fname]

    def describe(self, name: str) -> str:
        dataset = self.locations.get(name, "?")
        return f"{self.path}/{self._file_for(dataset) if dataset != '?' else KERAS_WEIGHTS}" \
               f" [{dataset}] ({name})"

    def read(self, name, blocks, shape):
        import ml_dtypes
        self.abstract  # noqa: B018  (builds self.locations)
        dataset = self.locations.get(name)
        if dataset is None:
            raise PretrainedError(f"{self.path}: keras-hub's {self.backbone} has no variable "
                                  f"{name}.")
        fname = self._file_for(dataset)
        h5 = self._open(fname)
        if dataset not in h5:
            raise PretrainedError(f"{self.path}/{fname}: tensor {dataset} ({name}) is "
                                  "missing; the weights file does not match config.json.")
        ds = h5[dataset]
        bf16 = ds.attrs.get("dtype") == "bfloat16"
        self._check(name, ds.shape, "bfloat16" if bf16 else ds.dtype, shape)
        out = {}
        for block in blocks:
            part = ds[block_slices(*block)] if len(shape) else ds[()]
            part = np.asarray(part)
            if bf16:  # h5py stores bfloat16 as 2-byte opaque values
                part = part.view(ml_dtypes.bfloat16) if part.dtype.itemsize == 2 \
                    else part.astype(ml_dtypes.bfloat16)
            out[block] = part
        return out

    def stored(self) -> List[str]:
        """Every dataset of the weights file(s), to find tensors nothing consumed."""
        names = []
        for fname in self._weight_files():
            self._open(fname).visititems(
                lambda n, o: names.append(n) if isinstance(o, self._h5py.Dataset) else None)
        return names

    def close(self):
        for f in self._files.values():
            f.close()
        self._files = {}


class HuggingFaceSource(Source):
    """A Hugging Face Transformers folder (config.json + *.safetensors)."""

    format = "huggingface"

    def __init__(self, path: str, loader):
        super().__init__(path, loader)
        self._reader = None
        self.ported: Dict[str, tuple] = {}
        self._files()  # every weight file name checked before keras-hub's reader opens one

    def _prepare(self):
        self._reader = internals.recording_safetensor_loader(self.path)
        self._reader.__enter__()
        try:
            self.loader.converter.convert_weights(self._abstract, self._reader,
                                                  self.hf_config)
        except (KeyError, FileNotFoundError, OSError) as e:
            self.close()
            raise PretrainedError(f"{self.path}: keras-hub's {self.backbone} converter could "
                                  f"not find a tensor ({e}); the safetensors files do not "
                                  "match config.json.") from None
        self.ported = {self.keras_hub.variable_name(path): v
                       for path, v in self._reader.ported.items()}

    def _backbone(self):
        self.hf_config = transformers4_rope(self.loader.config, self.path)
        check_computation_keys(self.hf_config, self.path)
        converter = self.loader.converter
        convert = converter.convert_backbone_config
        if len(inspect.signature(convert).parameters) != 1:
            raise PretrainedError(f"{self.path}: model_type "
                                  f"{self.hf_config.get('model_type')!r} needs a task-specific "
                                  "converter tfllm does not drive.")
        try:
            config = dict(convert(self.hf_config))
            if "use_sliding_window" in config:  # keras-hub 0.32's Qwen converter's name
                config["use_sliding_window_attention"] = config.pop("use_sliding_window")
            eps = self.hf_config.get("rms_norm_eps")
            if eps is not None and "layer_norm_epsilon" not in config:
                # keras-hub 0.32's Llama converter drops rms_norm_eps (Llama 3 uses 1e-5,
                # keras-hub's default is 1e-6); the checkpoint's own value is the model's.
                config["layer_norm_epsilon"] = float(eps)
        except (KeyError, ValueError) as e:
            raise PretrainedError(f"{self.path}/config.json: keras-hub's converter rejects it "
                                  f"({e}).") from None
        scaling = self.hf_config.get("rope_scaling")
        if scaling and not any(k in config for k in _SCALING_KEYS):
            # keras-hub 0.32's Qwen2, Mistral and Llama 2 converters drop rope_scaling
            # (linear, dynamic, yarn): the model would import unscaled, silently. An
            # architecture tfllm does not hold is named first (backbone_for).
            backbone_for(converter.backbone_cls.__name__, os.path.join(self.path, "config.json"))
            raise PretrainedError(
                f"{self.path}/config.json: rope_scaling={scaling!r} is not implemented "
                f"for model_type {self.hf_config.get('model_type')!r} (keras-hub's "
                "converter drops it and the model would compute other logits); tfllm "
                "imports RoPE scaling only as Llama 3's rope_type 'llama3'.")
        return converter.backbone_cls, config

    def describe(self, name: str) -> str:
        key = self.ported.get(name, ("?",))[0]
        return f"{self.path} [{key}] ({name})"

    def read(self, name, blocks, shape):
        self.abstract  # noqa: B018  (runs the converter: fills self.ported)
        if name not in self.ported:
            raise PretrainedError(f"{self.path}: keras-hub's converter maps no tensor to "
                                  f"{name}.")
        key, hook, kh_shape = self.ported[name]
        try:
            tensor = self._reader.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types
            raise PretrainedError(f"{self.path}: tensor {key} ({name}) cannot be read: "
                                  f"{e}") from None
        if str(tensor.dtype) not in FLOAT_DTYPES:
            self._check(name, shape, tensor.dtype, shape)
        if hook is not None:
            try:
                tensor = hook(np.asarray(tensor).view(_NoNarrowing), list(kh_shape))
            except ValueError as e:  # a reshape of a wrongly shaped tensor
                raise PretrainedError(f"{self.describe(name)}: shape {list(tensor.shape)} "
                                      f"cannot become {list(kh_shape)} ({e}); the weights do "
                                      "not belong to this config.json.") from None
        tensor = np.asarray(tensor)
        self._check(name, tensor.shape, tensor.dtype, shape)
        return {block: tensor[block_slices(*block)] if len(shape) else tensor for block in blocks}

    def stored(self) -> List[str]:
        names = []
        for fname in self._files():
            from safetensors import safe_open
            with safe_open(self.file(fname, self.path), framework="np") as f:
                names.extend(f.keys())
        return names

    def _files(self) -> List[str]:
        if os.path.exists(os.path.join(self.path, HF_INDEX)):
            return sorted(set(_file_names(self._weight_map(HF_INDEX))))
        self.file(HF_WEIGHTS, self.path)
        return [HF_WEIGHTS]

    def close(self):
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.__exit__(None, None, None)
            self._reader = None


def check_computation_keys(hf_config: dict, path: str) -> None:
    """Refuses a config.json setting that keras-hub's converter would silently drop (its
    family's `refused` keys, then those of every model_type)."""
    model_type = hf_config.get("model_type")
    family = FAMILIES.get(model_type)
    for key, accepted, computes in (family.refused if family else ()) + REFUSED_EVERYWHERE:
        value = hf_config.get(key)
        try:
            ok = accepted(value, hf_config)
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise PretrainedError(
                f"{path}/config.json: {key}={value!r} is not implemented for model_type "
                f"{model_type!r} (tfllm computes {computes}); importing it would compute "
                "other logits.")


#: keras-hub backbone arguments that carry a RoPE scaling a converter implemented
_SCALING_KEYS = ("rope_frequency_adjustment_factor", "rope_scaling_factor",
                 "global_rope_scaling_factor")


def transformers4_rope(hf_config: dict, path: str = "config.json") -> dict:
    """config.json's RoPE settings in the transformers-4 layout keras-hub's converters read.

    transformers 5 writes `rope_parameters` ({rope_type, rope_theta, factor, ...}) where
    transformers 4 wrote `rope_theta` and `rope_scaling`; keras-hub 0.32 reads the scaling
    only from `rope_scaling`, so a Llama 3.1 folder saved by transformers 5 was built
    without its llama3 scaling (logits 12-23% off, no error). A config holding both
    layouts that disagree is refused.
    """
    params = hf_config.get("rope_parameters")
    if not params:
        return hf_config
    if not isinstance(params, dict):
        raise PretrainedError(f"{path}/config.json: rope_parameters={params!r} is not an "
                              "object; the file is damaged.")
    if "full_attention" in params or "sliding_attention" in params:
        return hf_config  # RoPE per layer type (Gemma 3): its family reads it itself
    config = dict(hf_config)
    theta = params.get("rope_theta")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    for key, value in (("rope_theta", theta), ("rope_scaling", scaling)):
        if config.get(key) is not None and value is not None and config[key] != value:
            raise PretrainedError(f"{path}/config.json: {key}={config[key]!r} disagrees with "
                                  f"rope_parameters={params!r}; keep one of the two.")
        if value is not None:
            config[key] = value
    return config


class _NoNarrowing(np.ndarray):
    """A tensor that keeps its stored float type through a converter hook's casts.

    keras-hub 0.32's Mistral converter casts every tensor with `astype(np.float16)` before
    transposing it: float32 and bfloat16 weights lost precision or range on import
    (logits 6e-4 off transformers'). Given this view, a hook's transposes and reshapes
    still apply and a cast to another float type of no more bytes is skipped: weights are
    read exactly, or widened.
    """

    def astype(self, dtype, *args, **kwargs):
        target, stored = np.dtype(dtype), self.dtype
        floats = ("f", "V")  # V: ml_dtypes' bfloat16
        if (target != stored and target.kind in floats and stored.kind in floats
                and target.itemsize <= stored.itemsize):
            return self
        return super().astype(dtype, *args, **kwargs)


def open_source(path: str) -> Source:
    """The `Source` for a keras-hub preset or Hugging Face folder; PretrainedError when it
    is neither, or when its architecture is not one tfllm holds."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise PretrainedError(f"--preset {path}: no such directory; give a local keras-hub "
                              "preset (save_to_preset) or Hugging Face checkpoint folder.")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise PretrainedError(f"{path}: no config.json; a keras-hub preset or Hugging Face "
                              "checkpoint folder has one.")
    inside(path, "config.json", path, PretrainedError,  # not a link out of the folder
           root=hf_cache_repository(path))
    try:
        loader = internals.preset_loader(path)
    except ValueError as e:
        message = str(e).split("\n")[0]
        raise PretrainedError(f"{path}/config.json: {message} Supported: {supported()}.") \
            from None
    except json.JSONDecodeError as e:
        raise PretrainedError(f"{path}/config.json is not valid JSON ({e}).") from None
    kind = type(loader).__name__
    if kind == "KerasPresetLoader":
        return KerasPresetSource(path, loader)
    if kind == "TransformersPresetLoader":
        return HuggingFaceSource(path, loader)
    raise PretrainedError(f"{path}: a {kind} folder; tfllm imports keras-hub presets and "
                          f"Hugging Face folders of: {supported()}.")
