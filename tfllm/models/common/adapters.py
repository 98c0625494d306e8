"""Switching LoRA adapters off for a forward pass: DPO's reference model is the same
weights without their adapters (no second copy), as peft's `disable_adapter()`.

The switch is read when a forward pass is traced: inside a compiled step a forward
traced under `adapters_off()` is the base model's, one traced outside it the adapted
model's, both in the same program.
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def disabled() -> bool:
    """Whether forward passes traced now leave every LoRA adapter out."""
    return getattr(_state, "off", False)


@contextlib.contextmanager
def adapters_off():
    """Forward passes inside compute y = x W (+ bias): no adapter, no adapter dropout."""
    previous = disabled()
    _state.off = True
    try:
        yield
    finally:
        _state.off = previous
