"""`TfllmLM`: a restored tfllm run as an lm-evaluation-harness model ("tfllm").

lm-eval asks a model three things (`lm_eval.api.model.LM`): the log-likelihood of a
continuation after a context, the rolling log-likelihood of a whole text (perplexity
tasks) and a generation until a stop sequence. `TfllmLM` answers them as lm-eval's own
Hugging Face backend (`lm_eval.models.huggingface.HFLM`) does, step for step, so that a
run and its `tfllm export --format hf` folder score the same:

* tokenization: the run's tokenizer, the tokenizer folder's added tokens split out of the
  text as transformers splits them; a context's trailing spaces move to the continuation
  and the continuation's ids are those of context + continuation past the context's
  (`TemplateLM._encode_pair`); an empty context is the BOS id (else the end-of-text id);
* scoring: (context + continuation)[-(max_length + 1):], the continuation's ids scored
  by a float32 log-softmax, "greedy" when each is the argmax (`tfllm.evals.scorer`);
* rolling windows: lm-eval's own `get_rolling_token_windows` over max_length tokens;
* generation: the context left-truncated to max_length - max_gen_toks, greedy (or
  sampled when the task asks) with the run's KV-cache generator, the end-of-text id a
  stop, special tokens left out of the text, the text cut at the first stop sequence;
* chat: the run's chat template (`tfllm.data.chat_template`), with the generation prompt,
  or continuing the final message as transformers' `continue_final_message` does.

Everything runs on the run's mesh and precision: the model is the restored run's.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import jinja2
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tfllm.data.chat import added_token_ids, text_encoder
from tfllm.data.chat_template import folder_of, load_chat_template
from tfllm.data.errors import DataError
from tfllm.evals.scorer import Scorer
from tfllm.generate.generator import Generator
from tfllm.runpaths import RunPaths

#: lm-eval's default budget of generated tokens (HFLM.max_gen_toks)
MAX_GEN_TOKS = 256


@register_model("tfllm")
class TfllmLM(TemplateLM):
    """A restored tfllm run as an lm-eval model.

    Args:
      run: a `tfllm.train.run.Run` built for inference with its checkpoint's weights
        (`tfllm.train.saved_run.restored_run`), with a tokenizer.
      batch_size: requests per forward pass or generation batch.
      max_gen_toks: tokens a generation task may produce when it names no max_gen_toks.
      add_bos_token: put the BOS token before every request's text (lm-eval's
        add_bos_token; tfllm's tokenizers add none themselves).
    """

    def __init__(self, run, batch_size: int = 8, max_gen_toks: int = MAX_GEN_TOKS,
                 add_bos_token: bool = False):
        super().__init__()
        if run.tokenizer is None:
            raise DataError("this run has no tokenizer (data.source=synthetic): lm-eval "
                            "tasks are text; evaluate a run trained on text.")
        self.run, self.batch_size = run, int(batch_size)
        self.max_gen_toks, self.add_bos_token = int(max_gen_toks), bool(add_bos_token)
        data = run.config.data
        folder = folder_of(data.tokenizer_path) if data.tokenizer == "file" else None
        self.encode = text_encoder(run.tokenizer, added_token_ids(folder))
        #: the text of the prefix token: a text that starts with it gets no other (HFLM)
        self.prefix_text = run.tokenizer.decode([self.prefix_token_id])
        self.max_length = run.config.model.max_sequence_length
        self.scorer = Scorer(run.model, run.parallel, run.jit_compile, self.batch_size)
        self.generator = Generator(run.model, run.parallel, jit_compile=run.jit_compile)
        self._template = None

    # ---- tokens -----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.run.tokenizer.eod_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.run.tokenizer.bos_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.run.tokenizer.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs) -> List[int]:
        """The ids of `string`: with the BOS first under add_bos_token, unless
        `add_special_tokens` is False or the text already starts with it (HFLM's rule,
        with a tokenizer that adds the BOS when add_bos_token is set)."""
        add = self.add_bos_token and add_special_tokens is not False
        if add_special_tokens is None and self.prefix_text and \
                string.startswith(self.prefix_text):
            add = False
        bos = self.run.tokenizer.bos_id
        ids = ([bos] if add and bos is not None else []) + self.encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids) -> str:
        special = self.run.tokenizer.special_ids  # as decode(skip_special_tokens=True)
        return self.run.tokenizer.decode([int(i) for i in ids if int(i) not in special])

    # ---- log-likelihoods ----------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> List[Tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether each was the argmax) per
        (key, context ids, continuation ids), in the order given."""
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("a request's continuation is empty: nothing to score.")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer "
                                 f"than model.max_sequence_length ({self.max_length}).")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:]))
        # longest first: a batch's rows share a length bucket (lm-eval's order too)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        scored = self.scorer.score([rows[i] for i in order])
        answers = [None] * len(rows)
        for i, (log_probs, greedy) in zip(order, scored):
            n = len(requests[i][2])
            answers[i] = (float(log_probs[-n:].sum(dtype="float64")), bool(greedy[-n:].all()))
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Each text's log-likelihood over disjoint windows of max_length tokens."""
        windows, owners = [], []
        for index, (string,) in enumerate(r.args for r in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[index] += log_prob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation -----------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Each context's continuation, cut at the first of its stop sequences."""
        groups: Dict[str, List[int]] = {}
        for index, request in enumerate(requests):  # one generation setting per batch
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(index)
        out = [None] * len(requests)
        eos = self.run.tokenizer.decode([self.eot_token_id])
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]),
                                          self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            budget = int(kwargs.pop("max_gen_toks"))
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks {budget} leaves no room for a context in "
                                 f"model.max_sequence_length {self.max_length}; lower the "
                                 "task's max_gen_toks.")
            sampling = _sampling(kwargs)
            contexts = [requests[i].args[0] for i in indices]
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - budget)
                       for c in contexts]
            order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
            for at in range(0, len(order), self.batch_size):
                batch = order[at:at + self.batch_size]
                new = self.generator.generate([prompts[i] for i in batch], budget,
                                              eos_id=self.eot_token_id, **sampling)
                for i, ids in zip(batch, new):
                    text = postprocess_generated_text(self.tok_decode(ids), stop=until,
                                                      think_end_token=None)
                    out[indices[i]] = text
                    self.cache_hook.add_partial("generate_until", requests[indices[i]].args,
                                                text)
        return out

    # ---- chat ---------------------------------------------------------------------------
    def _chat_template(self):
        if self._template is None:
            # the run's own copy of its template (what it trained with), when it has one
            workdir = self.run.workdir
            own = workdir if workdir and os.path.isfile(
                RunPaths(workdir).chat_template_file) else None
            self._template = load_chat_template(self.run.config.data, own)
        return self._template

    def chat_template(self, chat_template=False) -> Optional[str]:
        """The source of the run's chat template (None when not asked for)."""
        if chat_template is False or chat_template is None:
            return None
        return self._chat_template().source

    def apply_chat_template(self, chat_history: List[dict],
                            add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the run's chat template, with the generation
        prompt, or (add_generation_prompt=False) ending right after the final message's
        content (transformers' continue_final_message); as HFLM, a template that refuses
        the conversation is tried again without its system messages."""
        template = self._chat_template()
        try:
            text = template.render(chat_history, add_generation_prompt)
        except jinja2.exceptions.TemplateError:
            chat_history = [m for m in chat_history if m["role"] != "system"]
            text = template.render(chat_history, add_generation_prompt)
        if add_generation_prompt or not chat_history:
            return text
        return _continue_final_message(text, chat_history[-1]["content"])


def _sampling(kwargs: dict) -> dict:
    """The generator's sampling settings of a task's normalized generation kwargs:
    greedy unless do_sample with a positive temperature."""
    if not kwargs.get("do_sample") or not kwargs.get("temperature"):
        return {}
    return {"temperature": float(kwargs["temperature"]), "top_k": int(kwargs.get("top_k") or 0),
            "top_p": float(kwargs.get("top_p") or 1.0), "seed": int(kwargs.get("seed") or 0)}


def _continue_final_message(text: str, final: str) -> str:
    """`text` cut right after `final`'s last occurrence (transformers'
    apply_chat_template(continue_final_message=True))."""
    at = text.rfind(final.strip())
    if at < 0:
        raise DataError("the chat template does not write the final message's content; it "
                        "cannot be continued.")
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]
