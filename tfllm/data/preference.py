"""Preference pairs (`data.format=preference`, DPO): records, TRL's tokenization, streams.

Each line of the JSONL files of data.paths is one pair in either of TRL's layouts:
  strings:       {"prompt": str, "chosen": str, "rejected": str}
  conversations: {"prompt": [messages], "chosen": [messages], "rejected": [messages],
                  "tools": [...]?}   (chosen / rejected: the assistant turn(s) that follow)
`prompt` may be left out (TRL's implicit prompt): the prompt is then the longest common
start of chosen and rejected (whole messages of conversations; characters of strings, a
space before the difference going with the completion, as `trl.extract_prompt`).
Messages are typed as chat data's (`tfllm.data.chat`); a broken line is one DataError
naming file:line.

Tokenized as TRL's DPOTrainer does, so that the ids are TRL's for the same record and
tokenizer: conversations render through the chat template as the prompt alone with the
generation prompt, prompt + chosen and prompt + rejected; strings are prompt + chosen
with the end-of-document id appended (TRL appends the tokenizer's eos text) and the
tokenizer's BOS when its tokenizer_config.json says `add_bos_token`. The prompt is the
common start of the three token sequences (a template that renders the generation
prompt differently from a continued conversation, or a merge across the boundary,
moves the completion's start back to where they agree); the completion is the rest.

Length rules (TRL's `max_length` with `truncation_mode="keep_start"`): each of a pair's
two sequences, prompt + completion, keeps its first data.sequence_length + 1 tokens (one
row); a pair whose prompt alone fills that is dropped (the count and the first lines
dropped are logged), since no completion token would be left. A completion of no token
is an error naming file:line.

In a batch, pair p of a micro-batch is rows 2p (chosen) and 2p + 1 (rejected): the two
halves always sit side by side, so the feed's batch split (an even number of rows per
device, `tfllm.data.feed`) never separates them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from tfllm.data import chat
from tfllm.data.errors import DataError

_FIX = ('each line must be {"prompt": ..., "chosen": ..., "rejected": ...}: all strings, '
        "or lists of messages (prompt optional: then chosen and rejected are whole "
        "conversations that share it)")


@dataclass
class PreferenceRecord:
    """One JSONL line of preference data: `where` is "file:line"; `prompt`, `chosen`,
    `rejected` are strings or lists of messages (`conversational`), the prompt made
    explicit."""

    where: str
    text: str
    prompt: Union[str, List[dict]]
    chosen: Union[str, List[dict]]
    rejected: Union[str, List[dict]]
    conversational: bool
    tools: Optional[list] = None


@dataclass
class PairSample:
    """A tokenized pair: each of chosen / rejected is (tokens (n,) int32, mask (n,) int8,
    1 on the completion's tokens, which are the trained targets); `index` is its place in
    its split's pairs (`tfllm.data.samples.prepare_samples`), which names its stored
    reference log-probabilities (dpo.precompute_reference)."""

    chosen: np.ndarray
    chosen_mask: np.ndarray
    rejected: np.ndarray
    rejected_mask: np.ndarray
    where: str
    index: int = -1


def pairs_digest(pairs: Sequence[PairSample]) -> str:
    """The sha256 of a split's tokenized pairs, in order (their ids and completion masks,
    each with its length): what stored reference log-probabilities were computed for."""
    digest = hashlib.sha256(b"tfllm preference pairs 1")
    for pair in pairs:
        for part in (pair.chosen, pair.chosen_mask, pair.rejected, pair.rejected_mask):
            part = np.ascontiguousarray(part)
            digest.update(np.int64(part.size).tobytes() + part.tobytes())
    return digest.hexdigest()


def implicit_prompt(chosen, rejected) -> int:
    """How much of chosen and rejected is their shared prompt (messages or characters),
    as TRL's `extract_prompt`: the common start, less a space just before the difference
    (it goes with the completion)."""
    k = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        k += 1
    if isinstance(chosen, str) and k > 0 and chosen[k - 1] == " ":
        k -= 1
    return k


def parse_line(line: str, where: str, fmt: str = "preference") -> PreferenceRecord:
    """One JSONL line as a PreferenceRecord; DataError naming `where` and the fix."""
    obj = chat.load_object(line, where, _FIX)
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise DataError(f'{where}: "{key}" is missing; {_FIX}.')
    conversational = isinstance(obj["chosen"], list)
    keys = ("prompt", "chosen", "rejected") if "prompt" in obj else ("chosen", "rejected")
    for key in keys:
        value = obj[key]
        if conversational:
            error = chat.message_error(value, key)
            if error:
                raise DataError(f"{where}: {error}; {_FIX}.")
        elif not isinstance(value, str):
            raise DataError(f'{where}: "{key}" is a {type(value).__name__} but "chosen" is a '
                            f"string (one layout per line); {_FIX}.")
    tools = obj.get("tools")
    if not chat.tools_ok(tools):
        raise DataError(f'{where}: "tools" is not a list of JSON schemas (objects); {_FIX}.')
    chosen, rejected = obj["chosen"], obj["rejected"]
    if "prompt" in obj:
        prompt = obj["prompt"]
    else:
        k = implicit_prompt(chosen, rejected)
        if conversational and (k == 0 or k >= min(len(chosen), len(rejected))):
            what = ("share no first message" if k == 0 else
                    "do not differ after their common messages")
            raise DataError(f"{where}: no \"prompt\", and chosen and rejected {what}, so "
                            "the prompt cannot be found; give \"prompt\", or make chosen "
                            "and rejected whole conversations that differ after it.")
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    return PreferenceRecord(where, line, prompt, chosen, rejected, conversational, tools)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def bos_prefix(folder: Optional[str]) -> List[int]:
    """[BOS id] when a tokenizer folder's tokenizer_config.json sets add_bos_token (what
    transformers then adds to a string it encodes, as TRL's strings layout does), else
    []."""
    config = chat.tokenizer_config(folder)
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if not (config.get("add_bos_token") and isinstance(bos, str)):
        return []
    ids = chat.added_token_ids(folder)
    return [ids[bos]] if bos in ids else []


class PairEncoder:
    """PreferenceRecords -> PairSamples, tokenized as TRL's DPOTrainer tokenizes them.

    Args:
      tokenizer: a `tfllm.data.tokenizer.Tokenizer`.
      template: the `ChatTemplate` (conversations), or None.
      added: the tokenizer folder's added tokens (`chat.added_token_ids`).
      max_tokens: tokens per sequence (data.sequence_length + 1).
      bos: ids put before a strings-layout text (`bos_prefix`).
    """

    def __init__(self, tokenizer, template=None, added=None, max_tokens: int = 0,
                 bos: Sequence[int] = ()):
        self.tokenizer, self.template, self.max_tokens = tokenizer, template, max_tokens
        self.encode = chat.text_encoder(tokenizer, added or {})
        self.bos = list(bos)
        #: records dropped because the prompt alone fills max_tokens ("file:line" each)
        self.dropped: List[str] = []

    def _render(self, record, messages, generation_prompt=False) -> str:
        if self.template is None:
            raise DataError(f"{record.where}: a conversation needs a chat template; set "
                            "data.chat_template (e.g. tfllm/data/templates/chatml.jinja) "
                            "or use a tokenizer folder that has one.")
        return chat.render_record(self.template, record, messages, generation_prompt, "pair")

    def ids(self, record: PreferenceRecord) -> Tuple[List[int], List[int], List[int]]:
        """(prompt, chosen, rejected) ids before any cut: TRL's prompt_ids, chosen_ids
        and rejected_ids."""
        if record.conversational:
            prompt = self.encode(self._render(record, record.prompt, True))
            whole = [self.encode(self._render(record, record.prompt + c))
                     for c in (record.chosen, record.rejected)]
        else:
            eos = self.tokenizer.eod_id
            prompt = self.bos + self.encode(record.prompt)
            whole = [self.bos + self.encode(record.prompt + c) + [eos]
                     for c in (record.chosen, record.rejected)]
        n = min(common_prefix(prompt, whole[0]), common_prefix(prompt, whole[1]))
        return prompt[:n], whole[0][n:], whole[1][n:]

    def __call__(self, record: PreferenceRecord) -> Optional[PairSample]:
        """The pair's sample, or None when its prompt alone fills max_tokens (dropped)."""
        prompt, chosen, rejected = self.ids(record)
        for name, ids in (("chosen", chosen), ("rejected", rejected)):
            if not ids:
                raise DataError(f"{record.where}: \"{name}\" gives no completion token after "
                                "the prompt; give it a reply or remove the pair.")
        if self.max_tokens and len(prompt) >= self.max_tokens:
            self.dropped.append(record.where)
            return None
        parts = []
        for completion in (chosen, rejected):
            tokens = np.asarray(prompt + completion, np.int32)
            mask = np.concatenate([np.zeros(len(prompt), np.int8),
                                   np.ones(len(completion), np.int8)])
            if self.max_tokens:
                tokens, mask = tokens[:self.max_tokens], mask[:self.max_tokens]
            parts += [tokens, mask]
        return PairSample(*parts, record.where)


def pair_rows(pair: Optional[PairSample], length: int):
    """The two rows (chosen, rejected) of a pair, each (tokens, segment_ids, loss_mask) of
    `length`, padded with 0 (segment 0); None gives two padding rows."""
    rows = []
    for tokens, mask in ((pair.chosen, pair.chosen_mask), (pair.rejected, pair.rejected_mask)
                         ) if pair is not None else ((np.zeros(0, np.int32),) * 2,) * 2:
        n = len(tokens)
        row = [np.zeros(length, np.int32) for _ in range(3)]
        row[0][:n], row[1][:n], row[2][:n] = tokens, 1, mask
        rows.append(row)
    return rows


class PairStream:
    """One pair per read from a stream's pairs, with a position that can be set.

    Args:
      pairs: this stream's PairSamples.
      seed: the stream's seed (`tfllm.data.pipeline.stream_seed`): each epoch reads the
        pairs in an order drawn from (seed, epoch), so the n-th pair is a pure function
        of (pairs, seed, n); None: in order, once, then padding (validation).
    """

    def __init__(self, pairs: Sequence[PairSample], seed: Optional[int]):
        self.pairs, self.seed = list(pairs), seed
        self.position = 0
        self._order: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def exhausted(self) -> bool:
        """A validation stream past its last pair (it yields padding from here on)."""
        return self.seed is None and self.position >= len(self.pairs)

    def __next__(self) -> Optional[PairSample]:
        n, self.position = self.position, self.position + 1
        if self.seed is None:
            return self.pairs[n] if n < len(self.pairs) else None
        epoch, i = divmod(n, len(self.pairs))
        if self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(len(self.pairs)))
        return self.pairs[int(self._order[1][i])]
