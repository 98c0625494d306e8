"""The samples of a split: for SFT (data.format messages / prompt_completion) read,
rendered, masked and tokenized once per process (`tfllm.data.chat`), then packed per row
stream by `tfllm.data.pipeline.Batches`; for DPO (data.format preference) the pairs
(`tfllm.data.preference`), one pair per two rows."""

from __future__ import annotations

import logging
from typing import Dict, List

from tfllm.data.chat import Sample, SampleEncoder, added_token_ids, check_settings
from tfllm.data.chat_template import folder_of, load_chat_template
from tfllm.data.errors import DataError
from tfllm.data.preference import PairEncoder, PairSample, bos_prefix
from tfllm.data.sources import split_key, split_records

log = logging.getLogger("tfllm.data")


# Samples of a split, kept per process: training and every evaluation ask for them.
_PREPARED: Dict[tuple, List[Sample]] = {}


def prepare_samples(data, tokenizer, split: str, loss_on: str) -> List[Sample]:
    """Every sample of a split, tokenized with its loss mask, in file and line order.

    Validation data: data.eval_paths, else the lines of data.paths whose hash falls below
    data.validation_fraction (those are left out of training). A sample longer than
    data.sequence_length + 1 tokens is cut to that length (as TRL's max_length and
    torchtune's max_seq_len do); the count is logged.

    Args:
      data: the config's `DataConfig`.
      tokenizer: the run's `tfllm.data.tokenizer.Tokenizer`.
      split: "train" or "validation".
      loss_on: which target tokens are trained (`train.loss_on`).
    """
    check_settings(data, loss_on)
    template = load_chat_template(data) if data.format == "messages" else None
    if data.format == "preference":
        try:  # a strings layout needs none: a conversation without one names its line
            template = load_chat_template(data)
        except DataError:
            template = None
    length = data.sequence_length + 1
    cache_key = (split_key(data, split), split, data.format, loss_on, bool(data.eval_paths),
                 data.validation_fraction, template.source if template else None,
                 tokenizer.fingerprint(), length)
    if cache_key in _PREPARED:
        return _PREPARED[cache_key]
    records = split_records(data, split)
    folder = folder_of(data.tokenizer_path) if data.tokenizer == "file" else None
    if data.format == "preference":
        samples = _pairs(records, PairEncoder(tokenizer, template, added_token_ids(folder),
                                              length, bos_prefix(folder)), split, length)
        _PREPARED[cache_key] = samples
        return samples
    encoder = SampleEncoder(tokenizer, data.format, loss_on, template,
                            added_token_ids(folder), max_tokens=length)
    samples = [encoder(r) for r in records]
    if encoder.truncated:
        log.warning(f"{split}: {encoder.truncated} of {len(samples)} samples are longer "
                    f"than data.sequence_length + 1 = {length} tokens and were cut to it")
    if len(_PREPARED) >= 8:
        _PREPARED.clear()
    _PREPARED[cache_key] = samples
    return samples


def _pairs(records, encoder: PairEncoder, split: str, length: int) -> List[PairSample]:
    pairs = [p for p in map(encoder, records) if p is not None]
    for index, pair in enumerate(pairs):  # its place in the split: its reference's key
        pair.index = index
    if encoder.dropped:
        shown = ", ".join(encoder.dropped[:3]) + (", ..." if len(encoder.dropped) > 3 else "")
        log.warning(f"{split}: {len(encoder.dropped)} of {len(records)} preference pairs "
                    f"dropped: the prompt alone fills data.sequence_length + 1 = {length} "
                    f"tokens ({shown})")
    return pairs
