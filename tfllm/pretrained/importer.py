"""Pretrained weights into tfllm: `from_preset` (a model) and `import_preset` (a run).

The model section of the config is derived from the preset (keras-hub's converter reads
a Hugging Face config.json; `tfllm.families` maps keras-hub's backbone config
onto tfllm's). The model is built in its DTensor layouts first, then every weight is
filled block by block: each client reads, for each variable, only the blocks its own
devices hold (see `tfllm.pretrained.sources` for what each format allows), so no host
holds more than one tensor of the source at a time.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, Iterable, Optional

import numpy as np

from tfllm import files
from tfllm.confined import read_regular
from tfllm.checkpoint import model_variables
from tfllm.checkpoint.workdir import Workdir, read_marker, write_marker
from tfllm.contracts import MARKER
from tfllm.parallel.placement import block_slices
from tfllm.families import (Permuted, PretrainedError, Sliced, check_understood,
                            keras_hub_path)
from tfllm.pretrained.direct import open_preset
from tfllm.pretrained.sources import Source

log = logging.getLogger("tfllm.pretrained")

#: The training settings an imported run starts with: fine-tuning, not pre-training.
#: (Every one can be changed by --set at import or at `tfllm train`.)
FINE_TUNE_DEFAULTS = {"optimizer": {"learning_rate": 3e-5, "warmup_steps": 10,
                                    "weight_decay": 0.0},
                      "train": {"steps": 200, "log_every": 10, "eval_every": 100}}


def preset_model_section(source: Source) -> dict:
    """tfllm's `model` section for the preset (config.json -> keras-hub -> tfllm)."""
    if source.keras_hub is not None:  # else the family reads config.json (`config_in`)
        check_understood(source.keras_hub, source.config,
                         os.path.join(source.path, "config.json"))
    if source.hf_config is not None and source.family.config_in is not None:
        return source.family.config_in(source.hf_config, source.path)
    max_length = (source.hf_config or {}).get("max_position_embeddings")
    kh = source.config
    if (source.format == "keras-hub" and source.family.model_family == "llama"
            and "tie_word_embeddings" not in source.stated and "tie_word_embeddings" in kh):
        # (a backbone without the argument, Mistral's and Mixtral's, is untied)
        # Also builds the abstract backbone (h5 locations) tied, like the weights.
        kh["tie_word_embeddings"] = not source.stores_output_embedding()
    return source.keras_hub.model_fields(kh, max_length)


def preset_config(source: Source, overrides: Iterable[str] = (),
                  tokenizer_path: Optional[str] = None, recipe: Optional[str] = None):
    """The run config of an import: the preset's model, fine-tuning defaults, a recipe
    file, overrides.

    Args:
      source: the opened preset.
      overrides: 'section.key=value' strings, applied last (e.g. mesh.axes).
      tokenizer_path: where the run's tokenizer will be (data.tokenizer=file), or None to
        keep the default tokenizer settings.
      recipe: a YAML config file (e.g. configs/sft-lora.yaml) whose settings apply over
        the preset's and the defaults, before `overrides`; None: none.
    """
    from tfllm.config.loader import config_from_dict, read_config_file
    model = preset_model_section(source)
    data = {"sequence_length": min(128, model["max_sequence_length"])}
    if tokenizer_path:
        data.update(tokenizer="file", tokenizer_path=tokenizer_path)
    sections = {"model": model, "data": data, **{k: dict(v) for k, v in
                                                 FINE_TUNE_DEFAULTS.items()}}
    if recipe:
        from tfllm.config.loader import apply_dict
        from tfllm.config import schema
        probe = schema.Config()
        settings = read_config_file(recipe)
        apply_dict(probe, settings, recipe)  # its own errors name the recipe file
        for section, values in settings.items():
            sections.setdefault(section, {}).update(values)
    return config_from_dict(sections, overrides, recipe or f"{source.path}/config.json")


def load_weights(model, source: Source) -> dict:
    """Fills every weight of a built tfllm `model` from `source`, block by block.

    Every weight must come from the preset (FP8 amax histories, which are not weights,
    stay as they are); a preset variable tfllm has no place for is an error.

    Returns:
      {"tensors": weights filled, "bytes_read": bytes read by this client,
       "largest_read": the largest single read in bytes}.
    """
    from tfllm.checkpoint.shards import assign_blocks, target_blocks, tf_variable
    mapping = source.weight_map(model.config)
    prefix = model.name + "/"
    # LoRA adapters are no preset weights: they keep their init (or come from --adapter).
    ours = {v.path[len(prefix):] if v.path.startswith(prefix) else v.path: v
            for v in model.variables if getattr(v, "kind", None) != "fp8_state"
            and not v.path.endswith(("/lora_a", "/lora_b"))}
    unmapped = sorted(set(ours) - set(mapping))
    if unmapped:
        raise PretrainedError(f"tfllm's {model.config.family} model has weights no "
                              f"{source.backbone} tensor feeds: {unmapped[:5]}; a subclass "
                              "with extra weights cannot be imported from this preset.")
    left = sorted(set(source.variables) - {keras_hub_path(v) for v in mapping.values()})
    if left:
        raise PretrainedError(f"{source.path}: the {source.backbone} weights {left[:5]} have "
                              "no place in tfllm's model (e.g. an untied output embedding "
                              "with tie_embeddings=true); check the --set model.* overrides.")
    stats = {"tensors": 0, "bytes_read": 0, "largest_read": 0}
    for path in sorted(ours):
        var = tf_variable(ours[path], path)
        kh_name = keras_hub_path(mapping[path])
        if kh_name not in source.variables:
            raise PretrainedError(f"{source.path}: keras-hub's {source.backbone} has no "
                                  f"variable {kh_name} for tfllm's {path}; check the --set "
                                  "model.* overrides.")
        blocks = sorted({block for _, block in target_blocks(var)})
        shape = tuple(int(n) for n in var.shape)
        if isinstance(mapping[path], Permuted):  # read whole, permute, then cut the blocks
            kh_shape = source.variables[kh_name]
            whole = ((0,) * len(kh_shape), kh_shape)
            theirs = source.read(kh_name, [whole], kh_shape)[whole]
            full = mapping[path].to_ours(theirs)
            if full.shape != shape:
                raise PretrainedError(f"{source.describe(kh_name)}: shape {list(kh_shape)} "
                                      f"does not give tfllm's {path} {list(shape)}; check the "
                                      "--set model.* overrides.")
            arrays = {b: full[block_slices(*b)] for b in blocks}
            del theirs, full
        elif isinstance(mapping[path], Sliced):  # the same blocks, offset into its part
            kh_shape = source.variables[kh_name]
            part = mapping[path]
            if not part.holds(kh_shape, shape):
                raise PretrainedError(f"{source.describe(kh_name)}: shape {list(kh_shape)} "
                                      f"does not hold tfllm's {path} {list(shape)}; check the "
                                      "--set model.* overrides.")
            theirs = source.read(kh_name, [part.block(*b) for b in blocks], kh_shape)
            arrays = {b: theirs[part.block(*b)] for b in blocks}
            del theirs
        else:
            arrays = source.read(kh_name, blocks, shape)
        dtype = np.dtype(var.dtype.as_numpy_dtype)
        arrays = {b: np.asarray(a).astype(dtype) for b, a in arrays.items()}
        if not all(np.isfinite(a).all() for a in arrays.values()):  # after the cast: fp16 overflow
            raise PretrainedError(f"{source.describe(kh_name)}: holds NaN or infinite values "
                                  f"(tfllm's {path}); a model with them generates nonsense: "
                                  "import a folder whose weights are finite.")
        size = sum(a.nbytes for a in arrays.values())
        stats["bytes_read"] += size
        stats["largest_read"] = max(stats["largest_read"], size)
        assign_blocks(var, arrays)
        del arrays
        stats["tensors"] += 1
    return stats


def from_preset(preset: str, parallel=None, overrides: Iterable[str] = (), model_cls=None):
    """A tfllm model holding a keras-hub preset's or Hugging Face checkpoint's weights.

    Args:
      preset: a local keras-hub preset directory or Hugging Face checkpoint folder.
      parallel: a `tfllm.parallel.Parallel` to load onto a mesh (each client reads only
        its blocks), or None for one device.
      overrides: 'section.key=value' settings (e.g. precision.policy=bfloat16).
      model_cls: a `CausalLM` subclass to build instead of the family's class.

    Returns:
      The built model; `model.config` is its model section and `model.tfllm_config` the
      whole config it was built from.
    """
    from tfllm.models import build_model
    source = open_preset(preset)
    try:
        config = preset_config(source, overrides)
        model = build_model(config.model, config.precision, config.lora, parallel=parallel,
                            seed=config.train.seed, model_cls=model_cls, zeros=True)
        load_weights(model, source)
    finally:
        source.close()
    model.tfllm_config = config
    return model


# ---- tfllm import: a run directory at step 0 ------------------------------------------------
def _write_tokenizer(source: Source, tokenizer: Optional[str], out: Workdir) -> bool:
    """Writes the run's tokenizer into the run directory `out`: a SentencePiece model
    (WORKDIR/tokenizer/tokenizer.model: returns True) or a keras-hub tokenizer preset
    (WORKDIR/tokenizer: returns False)."""
    import keras

    from tfllm.data import DataError
    from tfllm.data.tokenizer import load_keras_hub_tokenizer
    if tokenizer:
        tokenizer = os.path.abspath(os.path.expanduser(tokenizer))
        if os.path.isdir(tokenizer):
            files.copy_tree(out.path, tokenizer, out.tokenizer_dir)
            return False
        if os.path.isfile(tokenizer):
            files.copy_file(out.path, tokenizer, out.tokenizer_model_file)
            return True
        raise PretrainedError(f"--tokenizer {tokenizer}: no such file or directory.")
    try:
        hub = load_keras_hub_tokenizer(
            source.path, fix="save the tokenizer into the preset (tokenizer.save_to_preset) or "
            "pass --tokenizer (a keras-hub tokenizer preset or a SentencePiece .model file)")
    except DataError as e:
        raise PretrainedError(str(e)) from None
    target = files.make_dirs(out.path, out.tokenizer_dir)  # keras-hub writes into it by path
    hub.save_to_preset(target)
    # Tokenizer.from_preset finds the tokenizer class through the backbone's config.json.
    files.write_atomically(out.path, os.path.join(target, "config.json"),
                           json.dumps(keras.saving.serialize_keras_object(source.abstract),
                                      indent=1))
    return False


def load_adapter(model, arrays: dict) -> int:
    """Assigns LoRA A/B arrays ({"block_i/<projection>/lora_a": array}, from
    `tfllm.pretrained.peft.read_adapter`) to the model's adapters; every adapter must get
    one. Returns how many were assigned."""
    from tfllm.checkpoint.shards import assign_blocks, target_blocks, tf_variable
    prefix = model.name + "/"
    ours = {v.path[len(prefix):]: v for v in model.variables
            if v.path.endswith(("/lora_a", "/lora_b"))}
    if sorted(ours) != sorted(arrays):
        missing = sorted(set(ours) - set(arrays)) or sorted(set(arrays) - set(ours))
        raise PretrainedError(f"--adapter: its modules do not match the model's "
                              f"({missing[:3]}); is it an adapter of this base?")
    for path, var in ours.items():
        shape = tuple(int(n) for n in var.shape)
        # A (in..., r) and B (r, out...) flattened as peft's matrices: only the model's own
        # split of in or out (heads) is undone; any other shape is refused, never reshaped.
        flat = ((int(np.prod(shape[:-1])), shape[-1]) if path.endswith("/lora_a")
                else (shape[0], int(np.prod(shape[1:]))))
        if tuple(arrays[path].shape) != flat:
            raise PretrainedError(f"--adapter: {path} is {list(arrays[path].shape)} (tfllm's "
                                  f"order of peft's matrix), the model's is {list(flat)}; is "
                                  "it an adapter of this base?")
        var = tf_variable(var, path)
        full = arrays[path].reshape(shape).astype(np.dtype(var.dtype.as_numpy_dtype))
        blocks = sorted({block for _, block in target_blocks(var)})
        assign_blocks(var, {b: full[block_slices(*b)] for b in blocks})
    return len(ours)


def import_preset(preset: str, workdir: str, overrides: Iterable[str] = (),
                  tokenizer: Optional[str] = None, adapter: Optional[str] = None,
                  recipe: Optional[str] = None) -> dict:
    """Writes `workdir` as a tfllm run at step 0 holding the preset's weights.

    The run directory gets config.yaml (the model section derived from the preset, the
    fine-tuning defaults of `FINE_TUNE_DEFAULTS`, then `overrides`), a committed
    checkpoint of the model weights (step 0, marked as an initialization, so that
    `tfllm train` starts a fine-tuning run from it with any data and optimizer
    settings), the tokenizer, and pretrained.json (where the weights came from, for
    `tfllm export --format keras-hub`) and the `.tfllm-run` marker of a tfllm run
    (`tfllm.checkpoint.workdir`). Everything is written under a temporary name
    and renamed last: a failed import leaves no workdir (a crashed one leaves
    WORKDIR.importing, whose marker lets the next import remove it).

    Args:
      preset: a local keras-hub preset or Hugging Face checkpoint folder.
      workdir: the new run directory (must not exist, or be empty).
      overrides: 'section.key=value' (e.g. mesh.axes=data=2,model=4).
      tokenizer: a tokenizer to use instead of the preset's: a keras-hub tokenizer
        preset directory or a SentencePiece .model file.
      adapter: a PEFT LoRA adapter folder of this base: its lora settings join the run's
        config and its A/B weights the checkpoint.
      recipe: a YAML config file of fine-tuning settings (data, train, lora, ...) applied
        over the preset's config (`preset_config`).

    Returns:
      A summary: workdir, backbone, format, params, tensors, bytes_read, largest_read.
    """
    from tfllm.checkpoint import agree_nonce
    from tfllm.config.loader import to_dict
    from tfllm.data.chat_template import copy_template_files, store_chat_template
    from tfllm.data.tokenizer import _check_vocab, from_file
    from tfllm.models import build_model
    from tfllm.parallel import make_parallel
    from tfllm.contracts import client_id, num_clients

    workdir = os.path.abspath(os.path.expanduser(workdir))
    if os.path.exists(workdir) and (not os.path.isdir(workdir) or os.listdir(workdir)):
        raise PretrainedError(f"--workdir {workdir} exists and is not empty; import into a "
                              "new directory (an import never overwrites a run).")
    tmp = workdir.rstrip("/") + ".importing"
    parent = os.path.dirname(workdir)  # the root of the import's own folder and its rename
    tmp_dir = Workdir(tmp)
    primary = client_id() == 0
    if primary:  # before any client joins
        _remove_crashed_import(tmp)
    source = open_preset(preset)
    try:
        adapter_arrays = None
        if adapter:
            from tfllm.pretrained.peft import read_adapter
            family = source.family.model_family
            settings, adapter_arrays = read_adapter(os.path.expanduser(adapter), family)
            overrides = [f"{k}={json.dumps(v)}" for k, v in settings.items()] + list(overrides)
        config = preset_config(source, overrides, Workdir(workdir).tokenizer_dir, recipe)
        if adapter_arrays is not None:  # in and out of every A and B: before any build
            from tfllm.pretrained.peft import check_adapter_shapes
            check_adapter_shapes(adapter_arrays, config.model, family,
                                 f"--adapter {adapter}")
        # The mesh next: splitting the CPU into logical devices must happen before
        # anything (the tokenizer, the abstract backbone) initializes TensorFlow; with
        # several clients it is also where they meet.
        parallel = make_parallel(config.mesh, config.model, config.optimizer)
        if primary:
            # The marker first: a crash leaves a folder provably this import's own.
            write_marker(tmp, "import")
            model_file = _write_tokenizer(source, tokenizer, tmp_dir)
            # The chat template (data.format=messages) with its special and added tokens.
            copy_template_files(source.path, tmp_dir.tokenizer_dir)
            store_chat_template(config.data, tmp)  # a recipe's data.chat_template
            where = lambda run: (run.tokenizer_model_file if model_file  # noqa: E731
                                 else run.tokenizer_dir)
            config.data.tokenizer_path = where(Workdir(workdir))
            # The tokenizer must load and fit the vocabulary before any weight is read.
            _check_vocab(from_file(where(tmp_dir)), config.model.vocab_size,
                         f"the tokenizer of {source.path}")
        # every weight is loaded
        model = build_model(config.model, config.precision, config.lora, parallel=parallel,
                            seed=config.train.seed, zeros=True)
        stats = load_weights(model, source)
        if adapter_arrays is not None:
            stats["adapter_tensors"] = load_adapter(model, adapter_arrays)
        origin = {"preset": source.path, "format": source.format,
                  "backbone": source.backbone, "backbone_config": source.config}
        checkpointer = tmp_dir.checkpointer(parallel, config.checkpoint)
        checkpointer.save(0, model_variables(model),
                          {"config": to_dict(config), "imported": origin})
        checkpointer.close()
        # Every client has seen the commit before client 0 moves the directory.
        agree_nonce(parallel.mesh, num_clients())
        if primary:
            tmp_dir.save_config(config)
            files.write_atomically(tmp, tmp_dir.pretrained_file,
                                   json.dumps(origin, indent=1, sort_keys=True))
            files.replace(parent, tmp, workdir)  # an empty --workdir is replaced by it
    except BaseException:
        if primary:  # only the import's own folder (made by this process)
            files.remove_tree(parent, tmp, ignore_errors=True)
        raise
    finally:
        source.close()
    from tfllm.models.lora import trainable_summary
    counts = trainable_summary(model)  # LoRA: the adapters train, the rest is frozen
    extra = {"trainable_params": counts["trainable"]} if config.lora.rank else {}
    return {"workdir": workdir, "backbone": source.backbone, "format": source.format,
            "params": counts["total"], **extra, "mesh": dict(parallel.shape), **stats}


def _remove_crashed_import(tmp: str) -> None:
    """Removes WORKDIR.importing when a crashed import left it (its marker says so);
    anything else by that name is not tfllm's to delete: refused."""
    if not os.path.lexists(tmp):
        return
    marker = None if os.path.islink(tmp) or not os.path.isdir(tmp) else read_marker(tmp)
    if marker is None or marker.get("kind") != "import":
        raise PretrainedError(f"{tmp} exists and is not a crashed tfllm import (it has no "
                              f"{MARKER} marker of one); tfllm never deletes files it did "
                              "not write: move it away, or import into another --workdir.")
    files.remove_tree(os.path.dirname(tmp), tmp)  # its name is tfllm's: NAME.importing


def read_origin(workdir: str) -> Optional[Dict]:
    """The pretrained.json of an imported run, or None."""
    path = Workdir(workdir).pretrained_file
    if not os.path.exists(path):
        return None
    try:  # a run anyone may have copied or edited: bounded, regular, strict
        origin = json.loads(read_regular(path, 1 << 20, "pretrained.json", PretrainedError))
    except (ValueError, RecursionError) as e:
        if isinstance(e, PretrainedError):
            raise
        raise PretrainedError(f"{path}: not JSON ({' '.join(str(e).split())[:120]}); it is "
                              "written by tfllm import: restore it or import again.") from None
    return origin if isinstance(origin, dict) else None
