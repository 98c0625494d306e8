"""`Generator`: text generation with a KV cache and an XLA-compiled decode loop.

A request's prompts are left-padded to one length P, so that every row writes its
next token into the same cache slot; each row's first real slot is its position 0 and
the slots before it are masked out. One compiled call prefills the whole prompt and
picks the first token; a second compiled call runs the rest in a `tf.while_loop` over
a fixed-size cache of P + max_new_tokens slots. On a mesh, where DTensor leaves a loop
outside XLA (and now and then fails to register its expanded loop functions), a
one-token step is called per token instead (`Generator._decode_stepwise`).

On a mesh the batch dimension is sharded over the batch mesh axis (data, else fsdp),
which must divide it: a request with fewer rows (one prompt on data=2) is padded with
copies of its last prompt, and the copies' outputs are dropped.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tfllm.compiler.jit import Retraced
from tfllm.data import feed
from tfllm.generate.sampling import next_token
from tfllm.parallel import context
from tfllm.parallel.placement import to_numpy

_BATCH = feed.BATCH_AXES
_TOKENS = feed.TOKEN_AXES

Prompts = Union[Sequence[int], Sequence[Sequence[int]]]


class Generator:
    """Generates tokens from a `tfllm.models.CausalLM`, on one device or a mesh.

    Args:
      model: a built `CausalLM` whose variables are placed (`build_model`).
      parallel: the `tfllm.parallel.Parallel` the model's variables live on, or None.
      jit_compile: XLA-compile prefill and decode (and the no-cache reference).
    """

    def __init__(self, model, parallel=None, jit_compile: bool = True):
        # Decoding never splits the sequence (one new token per step, prompts of any
        # length); weights keep their layouts.
        self.model = model
        self.parallel = parallel.for_decoding() if parallel is not None else None
        def compiled(fn):
            return Retraced(fn, self.parallel, jit_compile)
        self._prefill = compiled(self._prefill_fn)
        self._decode = compiled(self._decode_fn)
        self._token_step = compiled(self._token_step_fn)
        self._reference_step = compiled(self._reference_step_fn)
        #: seconds and token counts of the last `generate` call (prefill, decode)
        self.last_timing = {}

    # ---- public API --------------------------------------------------------------------
    def generate(self, prompt_ids: Prompts, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_id: Optional[int] = None):
        """Generates up to `max_new_tokens` tokens after each prompt, with a KV cache.

        Args:
          prompt_ids: one prompt (a list of token ids) or a list of prompts.
          max_new_tokens: tokens to generate per prompt; prompt length plus this may not
            exceed model.max_sequence_length.
          temperature: 0 for greedy decoding, else the softmax temperature of sampling.
          top_k: sample among the k most likely tokens (0: no limit).
          top_p: sample from the smallest set of tokens whose probability reaches top_p
            (1.0: no limit).
          seed: the sampling seed; the same seed gives the same tokens.
          eos_id: stop a row after this token (which is not returned), or None.

        Returns:
          The new token ids: a list for one prompt, a list of lists for several.
        """
        request = self._request(prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                seed, eos_id)
        tokens, start, options, rows, single = request
        started = time.perf_counter()
        first, cache = self._prefill(tokens, start, options["scalars"], **options["static"])
        first_np = to_numpy(first)  # waits for the prefill, for the timing
        prefilled = time.perf_counter()
        # On a mesh decoding goes token by token, compiled or not: DTensor leaves a while
        # loop outside XLA, and (TF 2.21) now and then fails a loop program's first run
        # with "Cannot add function 'decode_..._cond' because a different function with
        # the same name already exists" even on fresh traces with names no other trace
        # had (CI, 2026-11-29: twice in ~2,000 tests, after `Retraced`'s retries; the
        # test passed alone). A token step has no loop for DTensor to expand.
        if self.parallel is None:  # one XLA program, the loop included
            out = self._decode(first, cache, start, options["scalars"],
                               prompt_length=int(tokens.shape[1]),
                               max_new_tokens=max_new_tokens, **options["static"])
            out = to_numpy(out)
        else:
            out = self._decode_stepwise(first, cache, start, options, int(tokens.shape[1]),
                                        max_new_tokens)
        done = time.perf_counter()
        assert (out[:, 0] == first_np).all()
        self.last_timing = {"prefill_s": prefilled - started, "decode_s": done - prefilled,
                            "rows": rows, "decode_tokens": rows * (max_new_tokens - 1)}
        return _finish(out[:rows], eos_id, single)

    def generate_no_cache(self, prompt_ids: Prompts, max_new_tokens: int,
                          temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                          seed: int = 0, eos_id: Optional[int] = None):
        """`generate` without a cache: a full forward over all tokens for every new token.

        The reference the cached path is tested against (same arguments, same result);
        quadratic in the length, so not for real use. Left padding is masked with
        segment ids (pads are segment 0, the prompt and its continuation segment 1).
        """
        tokens, start, options, rows, single = self._request(
            prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id)
        prompt = to_numpy(tokens)
        batch, length = prompt.shape
        buffer = np.zeros((batch, length + max_new_tokens), np.int32)  # (B, P + N)
        buffer[:, :length] = prompt
        start_np = to_numpy(start)
        segment_ids = None
        if start_np.any():
            segment_ids = (np.arange(buffer.shape[1])[None, :] >= start_np[:, None])
            segment_ids = self._put(segment_ids.astype(np.int32), _TOKENS)
        for step in range(max_new_tokens):
            token = self._reference_step(self._put(buffer, _TOKENS), segment_ids,
                                         self._put(np.int32(length - 1 + step), ()),
                                         self._put(np.int32(step), ()), options["scalars"],
                                         **options["static"])
            buffer[:, length + step] = to_numpy(token)
        return _finish(buffer[:rows, length:], eos_id, single)

    def _decode_stepwise(self, first, cache, start, options, prompt_length: int,
                         max_new_tokens: int) -> np.ndarray:
        """The decode loop on a mesh: one compiled token step called from Python.

        DTensor (TF 2.21) expands a `tf.while_loop` into TensorFlow's own control flow
        and XLA clusters none of it: the whole loop ran op by op (the executed graph held
        Enter/Merge/Switch and every Einsum outside XLA). The token step is XLA clusters
        on every device. The cache goes in and out of each step as it goes around the
        loop (`write_cache` rewrites it with a select either way). Tokens stay on the
        devices; the host looks at them only every `_STOP_CHECK` tokens (to stop once
        every row has emitted eos) and at the end.
        """
        scalars = options["scalars"]
        token = first
        done = self._put(np.zeros((first.shape[0],), np.bool_), _BATCH)
        tokens = [first]
        eos = int(to_numpy(scalars["eos_id"]))
        for step in range(1, max_new_tokens):
            token, done, cache = self._token_step(token, done, cache, start,
                                                  self._put(np.int32(step), ()), scalars,
                                                  prompt_length=prompt_length)
            tokens.append(token)
            if step % _STOP_CHECK == 0 and step + 1 < max_new_tokens:
                if np.all(to_numpy(done) | (to_numpy(token) == eos)):
                    break  # every row finished: the remaining columns stay 0 (unread)
        out = np.zeros((first.shape[0], max_new_tokens), np.int32)
        for column, t in enumerate(tokens):
            out[:, column] = to_numpy(t)
        return out

    # ---- compiled parts ------------------------------------------------------------------
    def _prefill_fn(self, tokens, start, scalars, cache_length):
        cache = self.model.init_cache(tokens.shape[0], cache_length)
        logits, cache = self.model.call_with_cache(tokens, cache, 0, start,
                                                   last_only=True)  # (B, 1, V)
        first = self._sample(logits[:, 0], tf.constant(0, tf.int32), scalars)
        return first, cache

    def _decode_fn(self, first, cache, start, scalars, cache_length, prompt_length,
                   max_new_tokens):
        del cache_length  # part of the trace key only: it shapes the cache
        batch = first.shape[0]
        column = tf.expand_dims(tf.range(max_new_tokens), 0)  # (1, N)
        out = tf.where(column == 0, tf.expand_dims(first, 1), tf.zeros((batch, max_new_tokens),
                                                              tf.int32))  # (B, N)
        out = context.constrain(out, _TOKENS, "generated")
        done = context.constrain(tf.equal(first, scalars["eos_id"]), _BATCH, "done")

        def more(step, token, cache, out, done):
            return tf.logical_and(step < max_new_tokens,
                                  tf.logical_not(tf.reduce_all(done)))

        def one_token(step, token, cache, out, done):
            # Token `step - 1` goes into slot P + step - 1; its logits give `step`.
            logits, cache = self.model.call_with_cache(
                tf.expand_dims(token, 1), cache, prompt_length + step - 1, start)  # (B, 1, V)
            token = self._sample(logits[:, 0], step, scalars)
            token = tf.where(done, scalars["eos_id"], token)  # finished rows repeat eos
            out = tf.where(column == step, tf.expand_dims(token, 1), out)
            done = tf.logical_or(done, tf.equal(token, scalars["eos_id"]))
            return (step + 1, context.constrain(token, _BATCH, "token"), cache,
                    context.constrain(out, _TOKENS, "generated"),
                    context.constrain(done, _BATCH, "done"))

        state = (tf.constant(1), context.constrain(first, _BATCH, "token"), cache, out,
                 done)
        # only off a mesh (on a mesh, `_decode_stepwise`)
        return tf.while_loop(more, one_token, state, name="decode")[3]

    def _token_step_fn(self, token, done, cache, start, step, scalars, prompt_length):
        done = tf.logical_or(done, tf.equal(token, scalars["eos_id"]))
        # Token `step - 1` goes into slot P + step - 1; its logits give `step`.
        logits, cache = self.model.call_with_cache(
            tf.expand_dims(token, 1), cache, prompt_length + step - 1, start)  # (B, 1, V)
        token = self._sample(logits[:, 0], step, scalars)
        token = tf.where(done, scalars["eos_id"], token)  # finished rows repeat eos
        return token, context.constrain(done, _BATCH, "done"), cache

    def _reference_step_fn(self, buffer, segment_ids, position, step, scalars,
                           cache_length):
        del cache_length
        logits = self.model(buffer, segment_ids=segment_ids)  # (B, P + N, V)
        last = tf.gather(logits, position, axis=1)  # (B, V)
        return self._sample(last, step, scalars)

    def _sample(self, logits, step, scalars):
        # Every row needs its whole vocabulary to pick a token.
        logits = context.constrain(logits, _TOKENS, "next_token_logits")  # (B, V)
        # Sampling settings are tensors, never trace-time constants: one program per
        # shape serves greedy and every sampling setting. (It also avoids a DTensor bug:
        # a mesh running a third, structurally different while-loop program failed with
        # "Cannot add function 'decode_a_body' because a different function ... exists".)
        token = next_token(logits, scalars["seed"], step, scalars["temperature"],
                           scalars["top_k"], scalars["top_p"])
        return context.constrain(token, _BATCH, "token")

    # ---- requests ------------------------------------------------------------------------
    def _request(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id):
        """Checks a request and lays out its padded prompts and options."""
        prompts, single = _as_prompts(prompt_ids)
        config = self.model.config
        limit = config.max_sequence_length
        longest = max(len(p) for p in prompts)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {max_new_tokens!r}; ask for at least 1 token.")
        if longest + max_new_tokens > limit:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {max_new_tokens} = "
                f"{longest + max_new_tokens} exceeds model.max_sequence_length ({limit}); "
                "shorten the prompt, ask for fewer tokens, or use a model trained with a "
                "larger model.max_sequence_length.")
        for p in prompts:
            bad = [t for t in p if not 0 <= t < config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, model.vocab_size={config.vocab_size}); use the "
                                 "model's tokenizer.")
        if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
            raise ValueError(f"temperature={temperature}, top_k={top_k}, top_p={top_p}: use "
                             "temperature >= 0 (0: greedy), top_k >= 0 (0: off) and "
                             "0 < top_p <= 1 (1: off).")
        rows = len(prompts)
        multiple = feed.batch_multiple(self.parallel)
        padded_rows = -(-rows // multiple) * multiple
        prompts = prompts + [prompts[-1]] * (padded_rows - rows)  # copies, dropped later
        tokens = np.zeros((padded_rows, longest), np.int32)  # (B, P) left-padded
        start = np.zeros((padded_rows,), np.int32)
        for row, p in enumerate(prompts):
            start[row] = longest - len(p)
            tokens[row, start[row]:] = p
        options = {
            "static": {"cache_length": longest + max_new_tokens},
            "scalars": {"seed": self._put(np.int32(seed), ()),
                        "temperature": self._put(np.float32(temperature), ()),
                        "top_k": self._put(np.int32(top_k), ()),
                        "top_p": self._put(np.float32(top_p), ()),
                        "eos_id": self._put(np.int32(-1 if eos_id is None else eos_id), ())},
        }
        return (self._put(tokens, _TOKENS), self._put(start, _BATCH), options, rows, single)

    def _put(self, array, logical_axes):
        """A numpy array as a tensor, laid out by its logical axes (the device feed)."""
        return feed.place(self.parallel, array, logical_axes, "generate input")


#: tokens between the host's looks at whether every row has finished (mesh decoding)
_STOP_CHECK = 8


def _as_prompts(prompt_ids):
    """(list of prompts, whether one prompt was given)."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids: empty; give a list of token ids or a list of them.")
    single = all(isinstance(t, (int, np.integer)) for t in prompt_ids)
    prompts = [list(prompt_ids)] if single else [list(p) for p in prompt_ids]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_ids: a prompt is empty; start it with at least one token "
                         "(e.g. the tokenizer's BOS token).")
    return [[int(t) for t in p] for p in prompts], single


def _finish(out: np.ndarray, eos_id, single: bool):
    """Rows of generated ids cut before the first eos_id."""
    rows = []
    for row in out.tolist():
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id)]
        rows.append(row)
    return rows[0] if single else rows
