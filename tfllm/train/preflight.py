"""Checks made before the first step of a run: what could fail after the last step fails
before the first.

The loop saves the final checkpoint before anything that follows the last step, so a
failure there loses no training; but a user should not learn of bad input hours late.
After the run is set up (the training data has given its first batch, the tokenizer is
loaded) and before step 1, `preflight` checks:

- the validation data, when the settings give any (`tfllm.data.sources.has_validation`),
  holds text: an empty validation split is an error naming the settings and the fix
  (it would fail the first evaluation, or the final one after every step);
- the tokenizer decodes every id it has and encodes the end-of-training sample's prompt,
  and the prompt leaves room in `model.max_sequence_length` to generate;
- the experiment trackers `tracking.loggers` names are installed (client 0).
"""

from __future__ import annotations

from tfllm.config.loader import ConfigError
from tfllm.data.errors import DataError
from tfllm.data.sources import (documents, has_validation, no_validation_reason,
                                validation_hint)
from tfllm.train.trackers import check_installed

__all__ = ["no_validation_reason", "preflight"]


def preflight(run) -> bool:
    """Checks what can be checked before training; raises `DataError`/`ConfigError`.

    Args:
      run: the set-up `tfllm.train.run.Run`.

    Returns:
      Whether the run evaluates: False when the settings give no validation data
      (data.validation_fraction=0 and no separate validation data).
    """
    config = run.config
    check_installed(config.tracking)
    evaluating = has_validation(config.data)
    if evaluating and config.data.source != "synthetic":
        _check_validation_text(run)
    if run.tokenizer is not None:
        _check_tokenizer(run)
    return evaluating


def _check_validation_text(run) -> None:
    # Whether the split has a document at all: one pipeline over the whole split, no
    # tokenizer, the same answer on every client (each reads the same documents). A
    # document of text gives at least one target token, so evaluation then counts some.
    docs = documents(run.config.data, "validation").take(1)
    if next(iter(docs), None) is None:
        raise DataError("the validation data holds no text, so evaluation would fail "
                        "(train.eval_every and at the end): "
                        + validation_hint(run.config.data))


def _check_tokenizer(run) -> None:
    tokenizer, t = run.tokenizer, run.config.train
    what = f"the tokenizer ({tokenizer.name})"
    try:
        tokenizer.decode(list(range(tokenizer.vocab_size)))
        ids = tokenizer.encode(t.sample_prompt)
        tokenizer.decode(ids)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001  (a broken tokenizer file fails in many ways)
        detail = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"{what} cannot encode and decode text ({type(e).__name__}: "
                        f"{detail}); replace its file, or choose another data.tokenizer."
                        ) from None
    limit = run.config.model.max_sequence_length
    if t.sample_tokens and len(ids) >= limit:
        raise ConfigError(f"train.sample_prompt is {len(ids)} tokens, model."
                          f"max_sequence_length is {limit}: nothing could be generated at "
                          "the end; shorten train.sample_prompt or set train.sample_tokens=0.")
