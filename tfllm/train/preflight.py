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

Before all that, before anything is built or written, `check_memory` refuses a run that
cannot fit: on GPUs the step's memory-fit estimate (`tfllm.footprint.fit`, seconds, no
compile) against this host's GPUs, with the `--set` that fits; on a CPU, weights alone
larger than the host's memory. `tfllm train` and `run_training` both make it.
"""

from __future__ import annotations

import os

from tfllm.config.loader import ConfigError
from tfllm.contracts import InputError
from tfllm.data.errors import DataError
from tfllm.data.sources import (documents, has_validation, no_validation_reason,
                                validation_hint)
from tfllm.train.trackers import check_installed

__all__ = ["check_host_memory", "check_memory", "no_validation_reason", "preflight"]


def check_memory(config) -> None:
    """Raises `InputError` (one line; `tfllm.footprint.fit.FitError` on GPUs, which names
    the `--set` that fits) when the run cannot fit this host, before anything is built.
    `train.memory_check=false` skips the GPU estimate, not the host's check."""
    from tfllm.runtime import gpu_checks
    check_host_memory(config)
    if not config.train.memory_check or not gpu_checks.wanted(config.mesh.device_type):
        return
    from tfllm.contracts import num_clients
    from tfllm.footprint.fit import check_host, host_gpus
    check_host(config, host_gpus(gpu_checks.driver_gpus(), os.environ), num_clients())


def check_host_memory(config) -> None:
    """A CPU run whose weights alone (float32, at least the sizes' lower bound) exceed
    this host's memory is refused before anything is allocated; on GPUs `check_memory`'s
    estimate is the check."""
    from tfllm.config.loader import weight_elements
    from tfllm.runtime import gpu_checks
    if gpu_checks.wanted(config.mesh.device_type):
        return
    need, host = 4 * weight_elements(config.model)[0], _host_memory()
    if host and need > host:
        raise InputError(f"model: at least {need / 2 ** 30:.1f} GiB of float32 weights, more "
                         f"than this host's {host / 2 ** 30:.1f} GiB of memory; lower "
                         "model.hidden_dim, model.num_layers or model.vocab_size, or run on "
                         "GPUs.")


def _host_memory() -> int:
    """Bytes of physical memory of this host (0 when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


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
