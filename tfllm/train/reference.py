"""DPO's precomputed reference (dpo.precompute_reference): one pass, stored with the run.

Before the first step the reference scores every pair once: each pair's summed
completion log-probabilities of chosen and rejected (`DpoLoss.live_reference_logps`), over
every training pair and every held-out pair, in the run's own layout (the feed's
`pair_batches`: each pair once, in order, on the run's mesh). Which reference: with LoRA
the model with its adapters off; in full fine-tuning the model's weights before the first
step (imported or initialized), so the run keeps no frozen copy. TRL's
`precompute_ref_log_probs=True` does the same.

Client 0 writes the values to WORKDIR/reference_logps.json, whole or not at all (written
aside, then renamed, as the run's other JSON files), with the sha256 of each split's
tokenized pairs (`tfllm.data.preference.pairs_digest`). A resumed run reads them back and
refuses, in one line, data whose pairs changed since: the stored values were computed by
weights that training has moved since, so they cannot be computed again. The table is
indexed by a pair's place in its split, not by a batch, so a resume on another mesh reads
the same values. The feed (`tfllm.data.feed.DeviceFeed.references`) hands each row's
value to the step as a fourth part of its micro-batch.

The values are JSON numbers: a float32 printed by Python's `repr` of the double it widens
to reads back as the same float32, so a resumed run computes with the very same bits.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Dict

import numpy as np
import tensorflow as tf

from tfllm.checkpoint.storage import write_json_atomic
from tfllm.compiler.jit import compile_fn
from tfllm.confined import read_regular
from tfllm.data.errors import DataError
from tfllm.data.preference import pairs_digest
from tfllm.data.sources import has_validation
from tfllm.parallel.placement import to_numpy
from tfllm.runpaths import RunPaths
from tfllm.train.step import lm_forward

#: the file's format tag (a file of another format is refused, not misread)
FORMAT = "tfllm reference log-probs 1"
#: the most bytes the file may have when read back (~40 bytes per pair: 25 million pairs)
MAX_BYTES = 2 ** 30
#: the splits a run stores
SPLITS = ("train", "validation")


@dataclass
class StoredReference:
    """The reference log-probabilities of a run's pairs.

    Args:
      tables: {split: (n, 2) float32}: pair i's chosen and rejected summed completion
        log-probabilities under the reference.
      digests: {split: `pairs_digest` of the split's tokenized pairs}.
      path: WORKDIR/reference_logps.json.
      seconds: how long the pass took (0: read back from `path`).
    """

    tables: Dict[str, np.ndarray]
    digests: Dict[str, str]
    path: str
    seconds: float = 0.0
    counts: Dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """What the run prints of it: where the values came from, and what they cost."""
        pairs = " and ".join(f"{len(t):,} {'training' if s == 'train' else 'held-out'}"
                             for s, t in self.tables.items())
        held = sum(t.nbytes for t in self.tables.values())
        how = (f"precomputed in one forward pass before the first step ({self.seconds:.1f} s)"
               if self.seconds else "read back")
        return (f"log-probabilities of {pairs} pairs {how}, stored in {self.path} (no "
                f"reference copy, no reference forward pass in the step: {held:,} bytes "
                "in host memory and 4 bytes per sequence of a batch)")


def _pair_logps(model, objective, packing_mask: bool):
    """(A, M) float32, replicated: the reference log-probs of every row of A
    micro-batches."""
    def logps(micro_batches):
        out = []
        for micro in micro_batches:
            values = objective.live_reference_logps(
                model, micro, lambda m, x: lm_forward(m, x, packing_mask))  # (M,)
            out.append(values)
        return tf.stack(out)  # (A, M)
    return logps


def compute(run, workdir: str) -> StoredReference:
    """Scores every pair of the run's splits with its reference (before the first step:
    the LoRA model's adapters are off in the pass, a fully fine-tuned model is still at
    its first weights).

    Args:
      run: the set-up `tfllm.train.run.Run` (its model restored or imported).
      workdir: the run directory (where the values are stored).
    """
    started = time.perf_counter()
    evaluator = run.evaluator
    fn = _pair_logps(run.model, evaluator.objective, evaluator.packing_mask)
    parallel = run.parallel
    if parallel is not None:
        # replicated: every client needs every row's value (client 0 writes the whole
        # table, and another client's rows are not its own); one small all-gather a batch
        inner = fn

        def fn(micro_batches):
            return parallel.constrain(inner(micro_batches), (None, None),
                                      "reference log-probs")
    compiled = compile_fn(fn, parallel, run.jit_compile)
    tables, digests = {}, {}
    for split in SPLITS:
        if split == "validation" and not has_validation(run.config.data):
            continue
        batches = run.feed.pair_batches(split)
        pairs = batches.all_pairs
        rows = batches.micro_batch_rows  # M, the rows of a micro-batch (2 per pair)
        streams = batches.micro_batches * rows // 2  # A * P: pairs per batch
        table = np.full((len(pairs), 2), np.nan, np.float32)
        for n, batch in enumerate(batches):
            values = to_numpy(compiled(run.feed.device_batch(batch, None)))  # (A, M)
            for a, row in np.ndindex(values.shape):
                index = a * rows // 2 + row // 2 + n * streams
                if index < len(pairs):
                    table[index, row % 2] = values[a, row]
        if np.isnan(table).any():  # every pair is read once: none may be missed
            raise RuntimeError(f"the reference pass over the {split} pairs left "
                               f"{int(np.isnan(table).any(axis=1).sum())} unscored")
        tables[split], digests[split] = table, pairs_digest(pairs)
    return StoredReference(tables, digests, RunPaths(workdir).reference_file,
                           time.perf_counter() - started)


def save(stored: StoredReference, workdir: str) -> None:
    """Writes WORKDIR/reference_logps.json whole or not at all (client 0)."""
    write_json_atomic(workdir, RunPaths(workdir).reference_file, {
        "format": FORMAT,
        **{split: {"digest": stored.digests[split], "pairs": len(table),
                   # float32 -> double -> repr: read back as the same float32
                   "chosen": [float(v) for v in table[:, 0]],
                   "rejected": [float(v) for v in table[:, 1]]}
           for split, table in stored.tables.items()}})


def load(workdir: str, batches_of) -> StoredReference:
    """The stored values of a resumed run, checked against the pairs the run reads now.

    Args:
      workdir: the run directory.
      batches_of: split -> the run's `pair_batches(split)` (whose `all_pairs` are
        hashed), for each split the file holds.

    Raises:
      DataError: the file is missing, unreadable, or was computed for other pairs (one
        line naming the file, the split and the fix).
    """
    path = RunPaths(workdir).reference_file
    fix = ("the reference cannot be computed again once training has moved the weights: "
           "restore the data (or the file) the run started with, or start a new --workdir")
    try:
        data = json.loads(read_regular(path, MAX_BYTES, "a reference log-prob file",
                                       DataError))
    except FileNotFoundError:
        raise DataError(f"{path} is missing: this run (dpo.precompute_reference=true) "
                        f"stored its reference log-probabilities there; {fix}.") from None
    except (OSError, ValueError) as e:
        detail = " ".join(str(e).split())
        raise DataError(f"{path} cannot be read ({detail}); {fix}.") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DataError(f"{path} is not a tfllm reference log-prob file ({FORMAT}); {fix}.")
    tables, digests = {}, {}
    for split, batches in batches_of.items():
        entry = data.get(split)
        digest = pairs_digest(batches.all_pairs)
        if not isinstance(entry, dict) or entry.get("digest") != digest:
            what = ("holds no values for them" if not isinstance(entry, dict) else
                    f"was computed for other pairs ({entry.get('pairs')} pairs, sha256 "
                    f"{str(entry.get('digest'))[:12]}; now {len(batches.all_pairs)}, "
                    f"{digest[:12]})")
            raise DataError(f"the {split} preference pairs changed since the run started: "
                            f"{path} {what}; {fix}.")
        try:
            table = np.stack([np.asarray(entry["chosen"], np.float32),
                              np.asarray(entry["rejected"], np.float32)], axis=1)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path}: the {split} values cannot be read ({e}); {fix}."
                            ) from None
        if table.shape != (len(batches.all_pairs), 2) or not np.isfinite(table).all():
            raise DataError(f"{path}: the {split} values are not one finite pair of "
                            f"numbers per pair; {fix}.")
        tables[split], digests[split] = table, digest
    return StoredReference(tables, digests, path)


def prepare(run, workdir: str, resumed: bool, primary: bool) -> StoredReference:
    """The run's reference log-probs, handed to its feed: computed and stored by a run
    that starts (client 0 writes), read back by a resumed one.

    Args:
      run: the set-up `tfllm.train.run.Run`, its weights restored (or imported).
      workdir: the run directory.
      resumed: the run continues from one of its own checkpoints.
      primary: this client writes the file.
    """
    if resumed:
        splits = [s for s in SPLITS
                  if s == "train" or has_validation(run.config.data)]
        stored = load(workdir, {s: run.feed.pair_batches(s) for s in splits})
    else:
        stored = compute(run, workdir)
        if primary:
            save(stored, workdir)
    run.feed.references = dict(stored.tables)
    return stored
