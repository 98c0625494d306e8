"""`Run`: everything a training run needs, set up from a config.

The mesh, the model in its layouts, AdamW, the loss scale, the compiled train and
evaluation steps, the tokenizer and this client's data streams. The loop
(`tfllm.train.loop`) drives it; `tfllm eval` and `tfllm generate` reuse it.
"""

from __future__ import annotations

import os
from typing import Optional

from tfllm.checkpoint import run_state_variables
from tfllm.compiler.jit import resolve_jit
from tfllm.config.loader import to_dict
from tfllm.contracts import client_id, num_clients
from tfllm.data.feed import DeviceFeed
from tfllm.generate import Generator
from tfllm.parallel import make_parallel
from tfllm.runtime.coordination import announce_ready, check_same_config, check_same_devices
from tfllm.runtime.devices import check_gpus
from tfllm.compiler import hlo_dump
from tfllm.train.evaluate import Evaluator
from tfllm.train.state import build_train_state


class Run:
    """Sets up a run.

    Args:
      config: a validated `tfllm.config.Config`.
      model_cls: a `CausalLM` subclass to train instead of the config's family.
      workdir: the run directory (the trained tokenizer is saved there), or None.
      with_data: build the tokenizer and data streams (False for export or layouts).
      train_iterator: open the training data stream (eval and generate do not need it).
      capture_hlo: dump the HLO XLA compiles (`tfllm.compiler.hlo_dump`) so that the step's
        cost report counts its FP8 GEMMs; `stop()` it after the first step.
      inference: the model alone (`tfllm generate`, `eval`): `evaluate` and generation
        work; there is no optimizer, loss scale or train step (`step` is None).
    """

    def __init__(self, config, model_cls=None, workdir: Optional[str] = None,
                 with_data: bool = True, train_iterator: bool = True,
                 capture_hlo: bool = False, inference: bool = False):
        self.config = config
        self.workdir = workdir
        t, d = config.train, config.data
        # A GPU host is checked first: a driver too old for TensorFlow's PTX, CUDA
        # libraries that fail to load (TensorFlow would fall back to the CPU without a
        # word), FP8 without FP8 tensor cores (tfllm.runtime.gpu_checks).
        check_gpus(config.mesh.device_type, config.precision.policy)
        # The mesh first: splitting the CPU into logical devices must happen before
        # anything (tf.data, tokenizer ops) initializes TensorFlow.
        self.parallel = make_parallel(config.mesh, config.model, config.optimizer)
        self._announce_ready()
        check_same_config(to_dict(config))  # before any collective can hang on a mismatch
        check_same_devices(self.parallel.device_type,
                           len(self.parallel.mesh.local_devices()))
        self.tokenizer = None
        if with_data and d.source != "synthetic":
            from tfllm.data.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(d, config.model.vocab_size, workdir)
        #: this client's device batches (training, validation) and the iterator's position;
        #: before the model, so that a batch that cannot be split is named as such
        self.feed = DeviceFeed(d, t, config.model.vocab_size, self.parallel, self.tokenizer,
                               with_data, train_iterator)
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
        #: DPO's frozen reference copy (full fine-tuning), or None
        self.reference = state.reference
        self.evaluator = Evaluator(self.model, self.parallel, self.jit_compile, packing,
                                   state.objective)

    def _announce_ready(self) -> None:
        """Every client says it joined the mesh, and answers the launcher's readiness
        handshake (TFLLM_READY_FILE / TFLLM_READY_KEY, see `tfllm.launch`)."""
        if num_clients() > 1:
            mesh = ", ".join(f"{k}={v}" for k, v in self.parallel.shape.items())
            print(f"tfllm: client {client_id()}/{num_clients()} ready on mesh [{mesh}]",
                  flush=True)
        announce_ready(os.environ)

    def evaluate(self, steps: Optional[int] = None) -> dict:
        """The validation loss and perplexity over `steps` batches (default
        `train.eval_steps`)."""
        return self.evaluator(self.feed.eval_batches(),
                              self.config.train.eval_steps if steps is None else steps)

    # ---- state --------------------------------------------------------------------------
    def state_variables(self) -> dict:
        """Every variable a checkpoint must hold, by a stable name."""
        return run_state_variables(self.model, self.optimizer, self.loss_scale,
                                   self.step.skipped if self.step is not None else None,
                                   self.reference)


class PromptError(ValueError):
    """A prompt the model cannot continue (empty, or no room for one new token)."""


def check_prompt(tokens: int, limit: int, name: str = "the prompt") -> None:
    """Raises `PromptError` unless a prompt of `tokens` leaves room for a new token within
    `limit` (model.max_sequence_length); `name` is how the message calls the prompt."""
    if not 0 < tokens < limit:
        raise PromptError(f"{name} is {tokens} tokens; the model takes 1 to {limit - 1} "
                          f"(model.max_sequence_length {limit} minus at least one new "
                          "token): shorten the prompt.")


def sample_text(run: Run, prompt: str, max_new_tokens: int, prompt_name: str = "the prompt",
                **sampling) -> str:
    """Generates a continuation of `prompt` with the run's model and tokenizer.

    Raises:
      ValueError: a run without a tokenizer; `PromptError` (`check_prompt`, the prompt
        called `prompt_name`) for a prompt it cannot continue.
    """
    if run.tokenizer is None:
        raise ValueError("this run has no tokenizer (data.source=synthetic); there is no "
                         "text to generate.")
    ids = run.tokenizer.encode(prompt)
    limit = run.config.model.max_sequence_length
    check_prompt(len(ids), limit, prompt_name)
    max_new_tokens = min(max_new_tokens, limit - len(ids))
    generator = Generator(run.model, run.parallel, jit_compile=run.jit_compile)
    new = generator.generate(ids, max_new_tokens, eos_id=run.tokenizer.eod_id, **sampling)
    return prompt + run.tokenizer.decode([int(i) for i in new])  # one prompt: a flat list
