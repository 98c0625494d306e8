"""Packing whole samples into rows (SFT): best-fit decreasing, one segment per sample.

A row holds whole samples, never a piece of one: segment ids 1, 2, ... number them
(the model restarts positions per segment and masks attention across them, with
data.packing_mask), the rest of the row is padding (segment 0, token 0, mask 0). A
sample's mask is 0 on its first token, so no label crosses a boundary. Samples are
placed by best-fit decreasing (TRL's "bfd" packing): longest first, each into the
fullest row it fits.

A training stream packs its samples afresh every epoch, after a shuffle seeded by
(data.seed, row, epoch), and shuffles the packed rows: its n-th row is a pure function
of (samples, seed, row, n), so the iterator's state is the count of rows read.
"""

from __future__ import annotations

import bisect
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

Row = Tuple[np.ndarray, np.ndarray, np.ndarray]  # tokens, segment_ids, loss_mask


def best_fit(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Best-fit decreasing: bins (lists of indices into `lengths`) of total length at most
    `capacity`; ties keep the order of `lengths`.

    Args:
      lengths: each item's length, every one at most `capacity`.
      capacity: the room of a bin.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: List[List[int]] = []
    free: List[Tuple[int, int]] = []  # (room left, bin), sorted
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))  # the least room that fits
        if at == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (room - lengths[i], b))
    return bins


def row_of(samples, indices: Sequence[int], length: int) -> Row:
    """One row of `length` from the samples at `indices` (each with .tokens and .mask)."""
    tokens = np.zeros(length, np.int32)
    segments = np.zeros(length, np.int32)
    mask = np.zeros(length, np.int32)
    at = 0
    for segment, i in enumerate(indices, 1):
        n = len(samples[i].tokens)
        tokens[at:at + n] = samples[i].tokens
        segments[at:at + n] = segment
        mask[at:at + n] = samples[i].mask
        at += n
    return tokens, segments, mask


def padding_row(length: int) -> Row:
    zeros = np.zeros(length, np.int32)
    return zeros, zeros, zeros


class PackedStream:
    """The packed rows of one row stream, with a position that can be set.

    Args:
      samples: this stream's samples (`tfllm.data.chat.Sample`), each at most `length`.
      length: tokens per row (data.sequence_length + 1).
      seed: the stream's seed (`tfllm.data.pipeline.stream_seed`); None: no shuffling and
        one pass (validation), then padding rows.
    """

    def __init__(self, samples, length: int, seed: Optional[int]):
        self.samples, self.length, self.seed = samples, length, seed
        self.position = 0  # rows read
        self._epoch: Optional[int] = None
        self._bins: List[List[int]] = []
        self._start = 0  # the first row of the packed epoch

    def epoch_bins(self, epoch: int) -> List[List[int]]:
        """The rows of `epoch` as lists of sample indices, in the order they are read."""
        if epoch != self._epoch:
            order = np.arange(len(self.samples))
            rng = None
            if self.seed is not None:
                rng = np.random.default_rng([self.seed, epoch])
                order = rng.permutation(len(self.samples))
            bins = best_fit([len(self.samples[i].tokens) for i in order], self.length)
            bins = [[int(order[i]) for i in b] for b in bins]
            if rng is not None:
                bins = [bins[i] for i in rng.permutation(len(bins))]
            self._epoch, self._bins = epoch, bins
        return self._bins

    def exhausted(self) -> bool:
        """A validation stream past its last row (it yields padding from here on)."""
        return self.seed is None and self.position >= len(self.epoch_bins(0))

    def __iter__(self) -> Iterator[Row]:
        return self

    def __next__(self) -> Row:
        if self.seed is None:
            bins = self.epoch_bins(0)
            row = (row_of(self.samples, bins[self.position], self.length)
                   if self.position < len(bins) else padding_row(self.length))
            self.position += 1
            return row
        if self._epoch is None or self.position < self._start:
            self.epoch_bins(0)
            self._start = 0
        while self.position >= self._start + len(self._bins):  # the next epoch's rows
            self._start += len(self._bins)
            self.epoch_bins(self._epoch + 1)
        row = row_of(self.samples, self._bins[self.position - self._start], self.length)
        self.position += 1
        return row
