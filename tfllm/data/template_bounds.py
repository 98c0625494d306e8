"""The bounds on a chat template's work: steps, sizes and time, counted in the sandbox.

A chat template comes from a downloaded model's tokenizer_config.json, so it is input like
any other: jinja's sandbox keeps it from reaching Python's internals, and this module keeps
it from taking the machine. Every render runs under a `Budget`:

* `MAX_TEMPLATE_STEPS` steps: a loop iteration (its body or its `if` test), a call (a
  macro, a method, a global), a filter, a test or an operator (each counting one step
  more per 64 items or characters of the values it reads), an attribute or item lookup;
* `MAX_TEMPLATE_CHARS` characters: of the rendered text, and of any value the template
  builds, prints (`{{ }}`) or joins (`~`) (a string; a list, counted with the strings it
  holds; a number's decimal digits: at most `MAX_TEMPLATE_DIGITS`,
  Python's own limit for printing one); a size argument (`'x'.ljust(n)`,
  `center(n)`, a format width) above it is refused before the value is built, and so is
  a string filter or method whose result may exceed 16 times the bound, judged from its
  value's size times its largest argument (`indent`, `join`, `replace`, `expandtabs`;
  `lipsum` is held to 1,000 paragraphs of 1,000 words);
* `MAX_TEMPLATE_SECONDS` of time, checked as the steps are counted.

The operators and filters are also what jinja folds at compile time: operators are
intercepted (`intercepted_binops`) and so never folded, and a filter called while
compiling refuses an oversized argument before its work, so `{{ 10**(10**9) }}` neither
compiles for hours nor renders. A bound that is hit is a `TemplateLimit` (a jinja
`TemplateError`), which the data pipeline reports as one line naming the template and
the sample.

How the steps are counted: `BoundedEnvironment` is jinja's immutable sandbox whose hooks
(`call`, `getattr`, `getitem`, `call_binop`, `call_test`, every filter) count, and whose
code generator adds a counting step to the body and the test of every `{% for %}` loop,
so a loop with an empty body is counted too, and passes every printed expression and every
`~` through a size check (so doubling a text by `{% set %}` statements is bounded).
"""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
import functools
import itertools
import math
import re
import time
from typing import Callable, Optional

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox

#: steps of one render (loop iterations, calls, filters, operators, lookups, items read)
MAX_TEMPLATE_STEPS = 1_000_000
#: characters of one render's text, and of any string or list a template builds
MAX_TEMPLATE_CHARS = 4_000_000
#: decimal digits of a number a template computes (Python prints no longer int)
MAX_TEMPLATE_DIGITS = 4300
#: seconds one render may take (a backstop: the steps bound the work first)
MAX_TEMPLATE_SECONDS = 30.0
# The clock is read once per this many steps (reading it every step would cost more than
# the step itself).
_CLOCK_EVERY = 4096
#: the clock renders are timed on (a test may replace it)
CLOCK = time.monotonic
_TICK = "tfllm_step"  # the filter the code generator's loop steps call
_VALUE = "tfllm_value"  # the filter it passes printed and joined values through
_NUMBER = re.compile(r"\d+")
# What a string filter or method may build, as a multiple of MAX_TEMPLATE_CHARS, judged
# before the work (the result is then held to MAX_TEMPLATE_CHARS itself).
_GROWTH = 16


class TemplateLimit(jinja2.exceptions.TemplateError):
    """A chat template went past one of its bounds (steps, characters, digits, time)."""


class Budget:
    """What one render (or compile) may still spend: steps, and time.

    Args:
      steps: the steps allowed (default MAX_TEMPLATE_STEPS, read when made).
      seconds: the time allowed (default MAX_TEMPLATE_SECONDS).
      clock: the clock the time is read on (default CLOCK: time.monotonic, which a test
        may replace with a fake one).
    """

    def __init__(self, steps: Optional[int] = None, seconds: Optional[float] = None,
                 clock: Optional[Callable[[], float]] = None):
        self.limit = MAX_TEMPLATE_STEPS if steps is None else steps
        self.steps = self.limit
        self.seconds = MAX_TEMPLATE_SECONDS if seconds is None else seconds
        self.clock = clock or CLOCK
        self.deadline = self.clock() + self.seconds
        self._next_clock = _CLOCK_EVERY

    def spend(self, n: int) -> None:
        self.steps -= n
        if self.steps < 0:
            raise TemplateLimit(f"more than {self.limit:,} steps (loop iterations, "
                                "calls, filters, operators, items read): the bound on a "
                                "chat template's work")
        self._next_clock -= n
        if self._next_clock <= 0:
            self._next_clock = _CLOCK_EVERY
            if self.clock() > self.deadline:
                raise TemplateLimit(f"rendering took more than {self.seconds:g} s (the "
                                    "bound on a chat template's time)")


_BUDGET: contextvars.ContextVar = contextvars.ContextVar("tfllm_template_budget",
                                                         default=None)


@contextlib.contextmanager
def budget(spent: Optional[Budget] = None):
    """Counts the renders inside against `spent` (a fresh `Budget` by default)."""
    token = _BUDGET.set(spent if spent is not None else Budget())
    try:
        yield _BUDGET.get()
    finally:
        _BUDGET.reset(token)


def _spend(n: int = 1) -> None:
    spent = _BUDGET.get()
    if spent is not None:  # outside a ChatTemplate's compile or render: not counted
        spent.spend(n)


def _items(value) -> int:
    """Steps for reading a value: one per 64 items or characters (read at C speed, where
    a step is a Python-level operation of the template)."""
    return _length(value) >> 6


def _length(value) -> int:
    """Items or characters a value holds (what reading it costs); 0 for a scalar."""
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, range)) else 0


def checked(value, what: str = "a value"):
    """`value` when it is within the size bounds, else TemplateLimit."""
    if isinstance(value, int) and not isinstance(value, bool):
        # bit_length * log10(2) is the number of decimal digits, to within one
        if value.bit_length() * 0.30103 > MAX_TEMPLATE_DIGITS + 1:
            raise TemplateLimit(f"{what} is a number of more than {MAX_TEMPLATE_DIGITS} "
                                "digits (the bound on a chat template's numbers)")
    elif _deep_size(value) > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"{what} would hold more than {MAX_TEMPLATE_CHARS:,} "
                            "characters or items (the bound on a chat template's values)")
    return value


def _deep_size(value) -> int:
    """Characters and items of a value with what it contains (a list of one long string
    repeated counts each repetition: printed or joined, it is that long); the walk stops
    once past MAX_TEMPLATE_CHARS, so it costs at most that many items."""
    if isinstance(value, (str, bytes)) or not _length(value):
        return _length(value)
    total, stack = 0, [value]
    while stack and total <= MAX_TEMPLATE_CHARS:
        item = stack.pop()
        total += _length(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
    return total


def _size_arguments(args, kwargs, what: str) -> None:
    """Refuses a size argument (an int) or a format width above MAX_TEMPLATE_CHARS, and an
    argument already past the bounds, before the work that would build from it."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) \
                and abs(value) > MAX_TEMPLATE_CHARS:
            raise TemplateLimit(f"{what}: a size of {value:.3g} is more than "
                                f"{MAX_TEMPLATE_CHARS:,} (the bound on a chat template's "
                                "values)")
        checked(value, what)


def _materialized(value, what: str):
    """An iterator (a generator of `map`, `select`, ...) as a list, so that what is built
    from it can be sized before the work; at most MAX_TEMPLATE_CHARS items, counted."""
    if not isinstance(value, collections.abc.Iterator):
        return value
    items = list(itertools.islice(value, MAX_TEMPLATE_CHARS + 1))
    _spend(1 + (len(items) >> 6))
    if len(items) > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"{what}: more than {MAX_TEMPLATE_CHARS:,} items (the bound on a "
                            "chat template's values)")
    return items


def _growth(value, args, kwargs, what: str) -> None:
    """Refuses work whose result may exceed the bound: what a string filter or method
    builds is at most (the value's size + 1) x (its largest size argument: an int, or a
    string's length), e.g. `indent(width)` per line, `replace(old, new)`, a separator
    joined between items, `wordwrap`'s wrapstring, `expandtabs`."""
    scale = max([1] + [abs(a) for a in (*args, *kwargs.values())
                       if isinstance(a, int) and not isinstance(a, bool)]
                + [len(a) for a in (*args, *kwargs.values()) if isinstance(a, str)])
    if (_deep_size(value) + 1) * scale > _GROWTH * MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"{what}: the result may hold more than {MAX_TEMPLATE_CHARS:,} "
                            "characters (the bound on a chat template's values)")


def _lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 (jinja's own argument names)
    """jinja's lipsum, bounded: at most 1,000 paragraphs of at most 1,000 words."""
    if not (isinstance(n, int) and isinstance(max, int) and n <= 1000 and max <= 1000):
        raise TemplateLimit("lipsum: at most 1,000 paragraphs of at most 1,000 words (the "
                            "bound on a chat template's values)")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _format_widths(fmt, what: str) -> None:
    """Refuses a format string ('%5000000s', '{:>5000000}') whose widths exceed the bound."""
    if isinstance(fmt, str) and any(len(n) > 7 or int(n) > MAX_TEMPLATE_CHARS
                                    for n in _NUMBER.findall(fmt)):
        raise TemplateLimit(f"{what}: a format width of more than {MAX_TEMPLATE_CHARS:,} "
                            "characters (the bound on a chat template's values)")


def _power_digits(base, exponent) -> float:
    """Decimal digits of base ** exponent for ints (0 when small or not ints)."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (base, exponent)):
        return 0.0
    if exponent <= 0 or abs(base) <= 1:
        return 0.0
    return exponent * math.log10(abs(base))


def _product_size(left, right) -> float:
    """Size of left * right: repeated sequence length, or decimal digits of two ints."""
    for seq, n in ((left, right), (right, left)):
        if _length(seq) and isinstance(n, int):
            return _length(seq) * max(n, 0)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right)):
        return (left.bit_length() + right.bit_length()) * 0.30103
    return 0.0


def _bounded_filter(name: str, f):
    # functools.wraps keeps jinja's marker of what the filter is passed (context,
    # environment), so jinja calls the wrapper exactly as it would call `f`.
    @functools.wraps(f)
    def run(*args, **kwargs):
        what = f"the filter {name}"
        lead = 0  # jinja's context, eval context or environment come first
        while lead < len(args) and isinstance(args[lead], (
                jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)):
            lead += 1
        args = (*args[:lead], *(_materialized(a, what) for a in args[lead:]))
        value = args[lead] if lead < len(args) else None
        _spend(1 + _items(value))
        _size_arguments(args, kwargs, what)
        _growth(value, args[lead + 1:], kwargs, what)
        if name == "format":
            _format_widths(value, what)
        return checked(f(*args, **kwargs), what)
    return run


@jinja2.pass_context  # never called while compiling (jinja folds no context filter)
def _loop_step(context, value=True):
    _spend(1)
    return value


@jinja2.pass_context
def _value_step(context, value):
    """What every `{{ expression }}` and `a ~ b` is passed through: counted by its
    length and refused past the size bounds (a block `{% set %}` that doubles its text,
    a `~` chain, a list of one long string printed)."""
    _spend(1 + _items(value))
    return checked(value, "a printed or joined value")


class _CountingCodeGenerator(jinja2.compiler.CodeGenerator):
    """jinja's code generator with a counting step in every loop body and loop test."""

    def _step(self, node, value=True):
        return jinja2.nodes.Filter(jinja2.nodes.Const(value), _TICK, [], [], None, None,
                                   lineno=node.lineno).set_environment(self.environment)

    def _sized(self, expr):
        return jinja2.nodes.Filter(expr, _VALUE, [], [], None, None, lineno=expr.lineno
                                   ).set_environment(self.environment)

    def visit_Template(self, node, frame=None):
        # Before the generator collects the filters the template names (the step's too).
        for output in node.find_all(jinja2.nodes.Output):
            output.nodes = [child if isinstance(child, jinja2.nodes.TemplateData)
                            else self._sized(child) for child in output.nodes]
        for concat in list(node.find_all(jinja2.nodes.Concat)):
            concat.nodes = [jinja2.nodes.Concat(concat.nodes, lineno=concat.lineno
                                                ).set_environment(self.environment)]
            concat.nodes = [self._sized(concat.nodes[0])]
        for loop in node.find_all(jinja2.nodes.For):
            loop.body = [jinja2.nodes.ExprStmt(self._step(loop), lineno=loop.lineno
                                               ).set_environment(self.environment),
                         *loop.body]
            if loop.test is not None:
                loop.test = jinja2.nodes.And(self._step(loop), loop.test, lineno=loop.lineno
                                             ).set_environment(self.environment)
        super().visit_Template(node, frame)


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, counting each render's work against its `Budget` and
    refusing values past the size bounds (see the module docstring)."""

    code_generator_class = _CountingCodeGenerator
    # Intercepted operators are also never folded at compile time.
    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters[_TICK], self.filters[_VALUE] = _loop_step, _value_step
        self.globals["lipsum"] = _lipsum

    def bound_filters(self) -> None:
        """Bounds the filters added since the environment was made (call after adding)."""
        self.filters = {name: f if f in (_loop_step, _value_step) or hasattr(f, "__wrapped__")
                        else _bounded_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context, operator, left, right):
        _spend(1 + _items(left) + _items(right))
        what = f"the operator {operator}"
        if operator == "**" and _power_digits(left, right) > MAX_TEMPLATE_DIGITS:
            raise TemplateLimit(f"{what}: {left} ** {right} is a number of more than "
                                f"{MAX_TEMPLATE_DIGITS} digits (the bound on a chat "
                                "template's numbers)")
        if operator == "*" and _product_size(left, right) > (
                MAX_TEMPLATE_CHARS if _length(left) or _length(right) else MAX_TEMPLATE_DIGITS):
            raise TemplateLimit(f"{what}: the product is larger than the bound on a chat "
                                f"template's values ({MAX_TEMPLATE_CHARS:,} characters, "
                                f"{MAX_TEMPLATE_DIGITS} digits)")
        if operator == "%":
            _format_widths(left, what)
        return checked(super().call_binop(context, operator, left, right), what)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        # str.format comes wrapped by the sandbox (its safe formatter)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        _spend(1 + _items(owner) + sum(_items(a) for a in args))
        name = getattr(__obj, "__name__", None) or getattr(__obj, "name", None)
        what = f"calling {name or 'a function'}"
        _size_arguments(args, kwargs, what)
        if isinstance(owner, str):
            args = tuple(_materialized(a, what) for a in args)  # str.join(generator)
            _growth(owner, args, kwargs, what)
            _growth(args[0] if len(args) == 1 and not isinstance(args[0], str) else "",
                    (owner,), {}, what)  # a separator joined between items
            if getattr(__obj, "__name__", "") in ("format", "format_map"):
                _format_widths(owner, what)
            if getattr(__obj, "__name__", "") == "replace" and len(args) >= 2 \
                    and isinstance(args[0], str) and isinstance(args[1], str):
                grown = (owner.count(args[0]) if args[0] else len(owner) + 1) * max(
                    len(args[1]) - len(args[0]), 0)
                if len(owner) + grown > MAX_TEMPLATE_CHARS:
                    raise TemplateLimit(f"{what}: the result would hold more than "
                                        f"{MAX_TEMPLATE_CHARS:,} characters (the bound on a "
                                        "chat template's values)")
        return checked(super().call(__context, __obj, *args, **kwargs), what)

    def call_test(self, name, value, args=None, kwargs=None, context=None, eval_ctx=None):
        _spend(1 + _items(value))
        return super().call_test(name, value, args, kwargs, context, eval_ctx)

    def getattr(self, obj, attribute):
        _spend(1)
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _spend(1)
        return super().getitem(obj, argument)
