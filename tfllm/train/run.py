"""`Run`: everything a training run needs, set up from a config.

The mesh, the model in its layouts, AdamW, the loss scale, the compiled train and
evaluation steps, the tokenizer and this client's data streams. The loop
(`tfllm.train.loop`) drives it; `tfllm eval` and `tfllm generate` reuse it.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Optional

from tfllm.checkpoint import CheckpointError
from tfllm.confined import inside
from tfllm.parallel import make_parallel
from tfllm.parallel import rules as rules_lib
from tfllm.parallel.mesh import check_batch, check_gpus
from tfllm.train import hlo_dump
from tfllm.train.evaluate import Evaluator
from tfllm.train.state import build_train_state
from tfllm.compiler.jit import resolve_jit


class Run:
    """Sets up a run.

    Args:
      config: a validated `tfllm.config.Config`.
      model_cls: a `CausalLM` subclass to train instead of the config's family.
      workdir: the run directory (the trained tokenizer is saved there), or None.
      with_data: build the tokenizer and data streams (False for export or layouts).
      train_iterator: open the training data stream (eval and generate do not need it).
      capture_hlo: dump the HLO XLA compiles (`tfllm.train.hlo_dump`) so that the step's
        cost report counts its FP8 GEMMs; `stop()` it after the first step.
      inference: the model without optimizer state (`tfllm generate`, `eval`):
        `evaluate` and generation work, `step` only places batches.
    """

    def __init__(self, config, model_cls=None, workdir: Optional[str] = None,
                 with_data: bool = True, train_iterator: bool = True,
                 capture_hlo: bool = False, inference: bool = False):
        self.config = config
        self.workdir = workdir
        t, d = config.train, config.data
        # A GPU host is checked first: a driver too old for TensorFlow's PTX, CUDA
        # libraries that fail to load (TensorFlow would fall back to the CPU without a
        # word), FP8 without FP8 tensor cores (tfllm.parallel.gpu_checks).
        check_gpus(config.mesh.device_type, config.precision.policy)
        # The mesh first: splitting the CPU into logical devices must happen before
        # anything (tf.data, tokenizer ops) initializes TensorFlow.
        self.parallel = make_parallel(config)
        self._announce_ready()
        from tfllm.config.loader import to_dict
        from tfllm.parallel.coordination import check_same_config, check_same_devices
        check_same_config(to_dict(config))  # before any collective can hang on a mismatch
        check_same_devices(self.parallel.device_type,
                           len(self.parallel.mesh.local_devices()))
        self.tokenizer = None
        if with_data and d.source != "synthetic":
            from tfllm.data.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(config, workdir)
        self.micro_batch_rows = t.global_batch_size // t.grad_accum_steps
        # The batch's own error first (naming train.global_batch_size or
        # data.sequence_length), before the generic sharding error could fire.
        rules, shape = self.parallel.rules, self.parallel.shape
        rows_axis = rules_lib.candidate_axis("activation_batch", rules, shape)
        check_batch(t.global_batch_size, t.grad_accum_steps, rows_axis, shape,
                    d.sequence_length, rules_lib.candidate_axis(
                        "activation_length", rules, shape, used=(rows_axis,)))
        self.batch_axis = self.parallel.batch_spec(
            (self.micro_batch_rows, d.sequence_length + 1))[0]
        self.sequence_axis = rules_lib.sequence_axis(self.micro_batch_rows, d.sequence_length,
                                                     rules, shape)
        self.jit_compile = resolve_jit(t.jit_compile, self.parallel.device_type)
        packing = d.packing_mask and d.source != "synthetic"
        if capture_hlo and self.jit_compile:
            # Before the model: XLA reads its flags at its first compilation, which on
            # GPU is the variables' initializers.
            hlo_dump.start()
        state = build_train_state(config, self.parallel, self.jit_compile, model_cls, packing,
                                  optimizer=not inference)
        self.model, self.optimizer = state.model, state.optimizer
        self.loss_scale, self.step = state.loss_scale, state.step
        self.evaluator = Evaluator(self.model, self.parallel, self.jit_compile, packing)
        self.rows = self.local_rows()
        self._synthetic = None
        self.train_data = None
        self._peeked = None
        if with_data:
            if d.source == "synthetic":
                from tfllm.data import SyntheticTokens
                self._synthetic = SyntheticTokens(config.model.vocab_size,
                                                  d.sequence_length + 1, d.seed)
            elif train_iterator:
                self.train_data = self.make_batches("train", t.grad_accum_steps)
                # Read one batch now: empty or too little data fails before the run
                # writes anything into its workdir.
                self._peeked = next(self.train_data)

    def _announce_ready(self) -> None:
        """Every client says it joined the mesh, and answers the launcher's readiness
        handshake (TFLLM_READY_FILE / TFLLM_READY_KEY, see `tfllm.launch`)."""
        from tfllm.contracts import announce_ready, client_id, num_clients
        if num_clients() > 1:
            mesh = ", ".join(f"{k}={v}" for k, v in self.parallel.shape.items())
            print(f"tfllm: client {client_id()}/{num_clients()} ready on mesh [{mesh}]",
                  flush=True)
        announce_ready(os.environ)

    def idle_batch_axes(self):
        """Token-splitting mesh axes (size > 1) that neither the batch's rows nor its
        sequence use: their devices repeat the same activations (custom rules only)."""
        p = self.parallel
        return sorted(a for a in p.batch_mesh_axes if p.shape.get(a, 1) > 1
                      and a not in (self.batch_axis, self.sequence_axis))

    # ---- data ---------------------------------------------------------------------------
    def local_rows(self) -> list:
        """The rows of each micro-batch that this client's devices hold."""
        shape = (self.micro_batch_rows, self.config.data.sequence_length + 1)
        spec = self.step.batch_spec(shape)
        rows = set()
        for _, start, size in self.parallel.local_blocks(shape, spec):
            rows.update(range(start[0], start[0] + size[0]))
        return sorted(rows)

    def make_batches(self, split: str, micro_batches: int, max_batches=None):
        from tfllm.data.pipeline import Batches
        return Batches(self.config, self.tokenizer, split=split, rows=self.rows,
                       micro_batches=micro_batches, micro_batch_rows=self.micro_batch_rows,
                       max_batches=max_batches)

    def _to_device(self, batch: dict):
        return self.step.from_local(batch["tokens"], self.rows, self.micro_batch_rows,
                                    batch.get("segment_ids"))

    def batch(self, step: int):
        """The device micro-batches of training step `step` (0-based).

        Synthetic batches are indexed by step; text sources are read in order.
        """
        if self._synthetic is not None:
            t = self.config.train
            return self.step.to_device(self._synthetic.batch(step, t.global_batch_size,
                                                             t.grad_accum_steps))
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return self._to_device(batch)
        return self._to_device(next(self.train_data))

    def eval_batches(self):
        """Device batches of the validation data, from its start (one micro-batch each)."""
        if self._synthetic is not None:
            # Steps far beyond any training run: held-out synthetic sequences.
            for i in range(10**9, 10**9 + 10**6):
                yield self.step.to_device(self._synthetic.batch(i, self.micro_batch_rows, 1))
            return
        steps = self.config.train.eval_steps
        for batch in self.make_batches("validation", 1, max_batches=steps):
            yield self._to_device(batch)

    def evaluate(self) -> dict:
        return self.evaluator(self.eval_batches(), self.config.train.eval_steps)

    # ---- state --------------------------------------------------------------------------
    def state_variables(self) -> dict:
        """Every variable a checkpoint must hold, by a stable name."""
        from tfllm.checkpoint import run_state_variables
        state = run_state_variables(self.model, self.optimizer, self.loss_scale)
        state["train/guard_skipped"] = self.step.skipped
        return state

    def data_state_files(self) -> dict:
        """This client's data-iterator state as {file name: bytes} (for a checkpoint)."""
        if self.train_data is None:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            self.train_data.save_state(os.path.join(tmp, "iterator"))
            return {name: open(os.path.join(tmp, name), "rb").read()
                    for name in sorted(os.listdir(tmp))}

    def restore_data_state(self, files: dict) -> None:
        """Restores the iterator from `data_state_files` output."""
        if self.train_data is None:
            return
        if not files:
            from tfllm.data import DataError
            raise DataError(
                "the checkpoint holds no data-iterator state for this client: it was saved "
                "with another number of clients (each client saves the position of its own "
                "rows). Resume with the same number of clients, or start a new --workdir.")
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in files.items():
                with open(_state_file(tmp, name), "wb") as f:
                    f.write(data)
            self.train_data.restore_state(os.path.join(tmp, "iterator"))
        self._peeked = None  # the restored position replaces the peeked first batch


# The names `data_state_files` gives: "iterator" + the suffixes tf.train.Checkpoint and
# Batches.save_state write (.json, .index, .data-00000-of-00001).
_STATE_FILE = re.compile(r"^iterator\.[A-Za-z0-9_.-]+$")


def _state_file(tmp: str, name) -> str:
    """Where a checkpoint's data-iterator file `name` is written for restoring: a plain
    file name of the form `data_state_files` gives, inside `tmp` (the names come from the
    checkpoint's manifest, which whoever made the checkpoint controls)."""
    what = "the checkpoint's data-iterator state"
    fix = ("the checkpoint was written by a buggy or malicious program: do not resume "
           "from it")
    if not (isinstance(name, str) and _STATE_FILE.match(name)):
        raise CheckpointError(f"{what}: {name!r} is not a file name tfllm writes "
                              f"(iterator.json, iterator.index, iterator.data-...); {fix}.")
    return inside(tmp, name, what, CheckpointError, flat=True, fix=fix)


def sample_text(run: Run, prompt: str, max_new_tokens: int, **sampling) -> str:
    """Generates a continuation of `prompt` with the run's model and tokenizer."""
    from tfllm.generate import Generator
    if run.tokenizer is None:
        raise ValueError("this run has no tokenizer (data.source=synthetic); there is no "
                         "text to generate.")
    ids = run.tokenizer.encode(prompt)
    limit = run.config.model.max_sequence_length
    if len(ids) >= limit:
        raise ValueError(f"the prompt is {len(ids)} tokens; model.max_sequence_length is "
                         f"{limit}: shorten the prompt.")
    max_new_tokens = min(max_new_tokens, limit - len(ids))
    generator = Generator(run.model, run.parallel, jit_compile=run.jit_compile)
    new = generator.generate(ids, max_new_tokens, eos_id=run.tokenizer.eod_id, **sampling)
    return prompt + run.tokenizer.decode([int(i) for i in new])  # one prompt: a flat list
