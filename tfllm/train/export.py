"""`tfllm export`: a trained run as an unsharded, single-device model.

The output directory holds:

* `saved_model/`: a TensorFlow SavedModel with a `serve(token_ids) -> logits` signature
  ((batch, length) int32 -> (batch, length, vocab) float32). Loading it needs only
  TensorFlow: `tf.saved_model.load(path).serve(ids)`; no tfllm, no mesh.
* `model.weights.h5`: the Keras weights, to load into
  `tfllm.models.build_model(config.model, config.precision, config.lora)` (no mesh)
  with `model.load_weights(...)` for fine-tuning or inspection in Keras.
* `config.yaml` and, when the run has one, `tokenizer/` (copied from the workdir).
"""

from __future__ import annotations

import os

import tensorflow as tf

from tfllm import files
from tfllm.checkpoint.workdir import Workdir, WorkdirError
from tfllm.config import save_config
from tfllm.models import build_model
from tfllm.runpaths import RunPaths


def export_model(config, workdir: str, out_dir: str) -> dict:
    """Restores the latest checkpoint onto one device and writes `out_dir`.

    Args:
      config: the run's config.
      workdir: the run directory (for the tokenizer).
      out_dir: the output directory: new or empty (never the workdir, a folder holding
        it, or the root); written under a temporary name and renamed last, so a failed
        export leaves nothing behind.

    Returns:
      A summary: out, step, params.
    """
    out_dir = files.require_new_folder(out_dir, WorkdirError, keep=(workdir,))
    run_dir = Workdir(workdir)
    # plain tf.Variables on one device
    model = build_model(config.model, config.precision, config.lora, seed=config.train.seed)
    meta = run_dir.restore_weights(model, config=config.checkpoint)
    with files.written_atomically(out_dir) as tmp:  # only its own temporary folder is deleted
        # Keras writes by path, into that new folder (made by tfllm.files: no link)
        model.save_weights(os.path.join(tmp, "model.weights.h5"))
        # Keras' own exporter: a SavedModel whose `serve` endpoint runs the model.
        model.export(os.path.join(tmp, "saved_model"), format="tf_saved_model",
                     input_signature=[tf.TensorSpec([None, None], tf.int32,
                                                    name="token_ids")],
                     verbose=False)
        save_config(config, tmp)
        if os.path.isdir(run_dir.tokenizer_dir):  # the export holds it as a run does
            # only the run's own files: a link planted in tokenizer/ is refused, never
            # followed out of the run into the export users upload
            files.copy_tree(tmp, run_dir.tokenizer_dir, RunPaths(tmp).tokenizer_dir,
                            within=workdir)
    params = sum(int(tf.size(v)) for v in model.trainable_variables)
    return {"out": out_dir, "step": int(meta["step"]), "params": params}
