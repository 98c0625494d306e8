"""Which printed figures of a notebook a fresh execution must reproduce, and how closely.

A notebook's stored outputs were made on one CPU; a fresh execution may run on another,
whose kernels (oneDNN's AMX, AVX-512 or AVX2 code paths, XLA's vector width) sum and
round in another order. What does not depend on that is compared exactly; what does is
compared by what it measures:

* Words, shapes, integers and claims (`True`, a bitwise `0.0e+00`) are equal
  (`same_line`): they are what the notebook teaches, and no kernel changes them.
* Decimals are within `REL_TOL` (2%) of the stored value or one unit of its last printed
  digit (float32 losses after 30 steps agree to ~1e-5 between CPUs; bfloat16 and FP8 ones
  to the few thousandths the two policies themselves differ by, under 0.2% of a loss of
  2.5; a real change, such as another MLP activation, moves a loss by 5%). Numbers in
  scientific notation state their own scale: within `REL_TOL` only, so a printed zero
  stays zero.
* Figures that are themselves rounding, or statistics of a model whose every weight
  carries the CPU's rounding, are named in `KERNEL_DEPENDENT`, one `Measured` line
  pattern each, with the check that fits what the figure measures and why: a round-off
  error against the bound the notebook claims (`AtMost`), the step where a maximum
  falls as any step of the run (`Between`), a statistic of trained tensors within the
  spread that separates what the notebook contrasts (`Near`).
* Cells tagged `nondeterministic` (timings, process ids) are compared by the kinds of
  output they make only (tests/notebooks/execute.py).

Where a `Measured` figure stands for a claim, the notebook also asserts the claim, so a
fresh execution fails on any machine when it stops being true.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

REL_TOL = 0.02  # decimals between a stored and a fresh run (see the module docstring)

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def tolerance(printed: str) -> float:
    """How far a fresh decimal may be from the stored `printed` one: REL_TOL of it, or
    one unit of its last printed digit when that is larger ("0.000" vs "0.001"). Numbers
    in scientific notation ("1.7e-06", "0.0e+00") state their scale: relative only, so
    a printed zero must stay zero and 1.7e-06 cannot become 9e-04."""
    value = abs(float(printed))
    if "e" in printed.lower():
        return REL_TOL * value
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return max(REL_TOL * value, 10.0 ** -decimals)


def same_line(stored: str, fresh: str) -> bool:
    """Equal words and integers; decimals within `tolerance` of the stored ones."""
    if _NUMBER.sub("#", stored) != _NUMBER.sub("#", fresh):
        return False
    for a, b in zip(_NUMBER.findall(stored), _NUMBER.findall(fresh)):
        if not any(c in a + b for c in ".eE"):
            if int(a) != int(b):
                return False
        elif abs(float(a) - float(b)) > tolerance(a) * (1 + 1e-9):  # 1.8 - 1.7 > 0.1
            return False
    return True


# ---- figures that depend on the CPU's kernels ----------------------------------------------
@dataclass(frozen=True)
class AtMost:
    """A round-off or parity error: any value from 0 to `bound`, the bound the notebook
    claims (and asserts), whatever the stored digits."""

    bound: float

    def accepts(self, stored: str, fresh: str) -> bool:
        return 0.0 <= float(fresh) <= self.bound

    def __str__(self):
        return f"at most {self.bound:g}"


@dataclass(frozen=True)
class Between:
    """An integer that a rounding can move anywhere in a range, such as the step where
    a maximum falls: any value from `low` to `high`."""

    low: int
    high: int

    def accepts(self, stored: str, fresh: str) -> bool:
        return float(fresh) == int(float(fresh)) and self.low <= int(float(fresh)) <= self.high

    def __str__(self):
        return f"from {self.low} to {self.high}"


@dataclass(frozen=True)
class Near:
    """A statistic of trained tensors: within `rel` of the stored value (relative), or
    `plus_minus` of it (absolute; for counts and figures near zero), whichever is larger."""

    rel: float = 0.0
    plus_minus: float = 0.0

    def accepts(self, stored: str, fresh: str) -> bool:
        a, b = float(stored), float(fresh)
        return abs(a - b) <= max(self.rel * abs(a), self.plus_minus)

    def __str__(self):
        parts = ([f"{100 * self.rel:g}%"] if self.rel else []) + (
            [f"{self.plus_minus:g}"] if self.plus_minus else [])
        return "within " + " or ".join(parts) + " of the stored value"


@dataclass(frozen=True)
class Binades:
    """An extreme of a tensor (its smallest or largest magnitude): within `n` binades
    (factors of 2) of the stored value, for positive values."""

    n: float

    def accepts(self, stored: str, fresh: str) -> bool:
        a, b = float(stored), float(fresh)
        return a > 0 and b > 0 and abs(math.log2(b / a)) <= self.n

    def __str__(self):
        return f"within {self.n:g} binade{'' if self.n == 1 else 's'} of the stored value"


@dataclass(frozen=True)
class Measured:
    """A printed line whose figures depend on the CPU's kernels.

    Args:
      pattern: a regular expression searched in each line of the notebook's text; each of
        its groups is one figure. The rest of the line is compared by `same_line`.
      figures: how each group's fresh value is judged against the stored one.
      why: what the figures measure, and so why that check.
    """

    pattern: str
    figures: tuple
    why: str

    def __post_init__(self):
        assert re.compile(self.pattern).groups == len(self.figures), self.pattern


STEPS = 30  # notebook 03's training runs

# Spreads quoted below were measured between the outputs stored on an AMD EPYC and fresh
# executions on an Intel Xeon with AMX, with its own kernels and with `--kernels avx512`
# and `eigen` (tests/notebooks/execute.py).
KERNEL_DEPENDENT = {
    "03_precision_and_fp8": (
        Measured(r"^(?:bfloat16|fp8) +largest \|loss - float32 loss\|: (\S+) \(step (\d+)\)$",
                 (AtMost(0.01), Between(1, STEPS)),
                 "the rounding of bfloat16 or FP8 against float32, which itself differs "
                 "between CPUs (0.0018 to 0.0066 measured): any value under the 'few "
                 "thousandths' the text claims and the cell asserts, at any step"),
        Measured(r"in +(\d+) of \d+ \(projection, step\) pairs; at most (\S+)x$",
                 (Near(rel=0.2), Near(rel=0.1)),
                 "steps where a tensor's amax beats its 16-step history: near-ties flip "
                 "with any rounding (counts 173 to 185 and 41 to 46 measured, factors "
                 "within 3%); the ordering the text draws from them is asserted in the cell"),
        Measured(r"\|values\| from (\S+) \(0\.1% below\) to (\S+) \((\d+) binades\)$",
                 (Binades(1), Near(rel=0.2), Near(plus_minus=1)),
                 "where a trained tensor's magnitudes begin and end: its 0.1st percentile "
                 "and its largest value move with any rounding (by 20% and 10% between "
                 "CPUs; the smallest value, which the notebook printed before, moved by 2.5 "
                 "binades), the span they give by a binade at most"),
        Measured(r"^(?:a|da|dW) +E(?:4M3|5M2) +own amax +(\S+) +(\S+) +(\S+)% +(\S+)$",
                 (Near(rel=0.1), Near(rel=0.1), AtMost(0.01), Near(rel=0.1)),
                 "a format's rounding error on a tensor, set by its mantissa bits (E5M2's "
                 "about twice E4M3's, asserted in the cell); the tensor's digits move it "
                 "by up to 7%; the share flushed to zero is the text's 'few thousandths of "
                 "a percent', asserted below 0.01%"),
    ),
    "05_fine_tuning": (
        Measured(r"largest \|difference\|: (\S+) \(logits",
                 (AtMost(2e-5),),
                 "float32 round-off between tfllm's and keras-hub's forward passes (1.4e-06 "
                 "to 1.9e-06 measured): any value within the bound of tests/pretrained, "
                 "which the cell asserts"),
    ),
}


def rules(notebook: str) -> tuple:
    """The `Measured` lines of a notebook ('03_precision_and_fp8' or a path to it)."""
    name = re.sub(r"\.ipynb$", "", notebook.rsplit("/", 1)[-1])
    return KERNEL_DEPENDENT.get(name, ())


def judge(stored: str, fresh: str, measured: tuple = ()) -> str:
    """'' when a fresh line reproduces the stored one, else why not.

    The first rule of `measured` whose pattern the stored line matches decides its
    figures; the rest of the line, and lines no rule matches, go by `same_line`.
    """
    for rule in measured:
        a = re.search(rule.pattern, stored)
        if not a:
            continue
        b = re.search(rule.pattern, fresh)
        if not b:
            return f"the line no longer matches {rule.pattern!r}"
        for i, figure in enumerate(rule.figures, start=1):
            if not figure.accepts(a.group(i), b.group(i)):
                return f"{b.group(i)} is not {figure} (stored {a.group(i)}: {rule.why})"
        return "" if same_line(_blank(a, stored), _blank(b, fresh)) else "its text differs"
    return "" if same_line(stored, fresh) else "its text differs"


def _blank(match, line: str) -> str:
    """`line` with the match's groups replaced by '#' (judged on their own)."""
    out, end = [], 0
    for i in range(1, match.re.groups + 1):
        out += [line[end:match.start(i)], "#"]
        end = match.end(i)
    return "".join(out) + line[end:]
