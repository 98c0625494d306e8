"""The active sharding setup, seen by model code only through `constrain`.

Model code never names a mesh axis: it calls `constrain(x, logical_axes)` on large
activations. Inside `use(parallel)` (the train step enters it while tracing) that
becomes a DTensor relayout chosen by the rules table; outside, it returns `x` as is,
so the same model runs on one device without DTensor.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional, Sequence

from tfllm.parallel import blocks, fsdp

_state = threading.local()


def current():
    """The `tfllm.parallel.Parallel` in effect, or None."""
    return getattr(_state, "parallel", None)


@contextlib.contextmanager
def use(parallel):
    """Makes `parallel` the active sharding setup for the duration of the block."""
    previous = current()
    _state.parallel = parallel
    try:
        yield parallel
    finally:
        _state.parallel = previous


def constrain(x, logical_axes: Sequence[Optional[str]], name: str = "activation"):
    """Lays out activation `x` by its logical axes under the active setup (else a no-op).

    Args:
      x: a tensor.
      logical_axes: one logical name per dimension, e.g.
        ("activation_batch", "activation_length", "activation_embed").
      name: used in error messages.
    """
    parallel = current()
    if parallel is None:
        return x
    return parallel.constrain(x, logical_axes, name)


def split_count(shape: Sequence[int], logical_axes: Sequence[Optional[str]], dim: int) -> int:
    """Into how many pieces the active setup splits dimension `dim` of a tensor of this
    shape and these logical axes (1 outside a setup). Lets model code keep work local to
    each piece (e.g. chunking queries within each device's part of the sequence)."""
    parallel = current()
    if parallel is None:
        return 1
    axis = parallel.spec("activation", list(shape), logical_axes)[dim]
    return parallel.shape[axis] if axis else 1


def gather_weight(w, logical_axes: Sequence[Optional[str]], name: str = "weight"):
    """A weight as its layer computes with it under the active setup (else a no-op).

    Weight dimensions sharded over a mesh axis that also shards the batch (FSDP) are
    all-gathered for the computation; the gradient flows back reduce-scattered to the
    weight's own layout. Tensor-parallel dimensions stay sharded.
    """
    parallel = current()
    if parallel is None:
        return w
    return parallel.gather_weight(w, logical_axes, name)


def weight_product(fn, x, w, logical_axes: Sequence[Optional[str]], name: str = "weight",
                   extra=(), equation: Optional[str] = None, einsum=None):
    """fn(x, w, *extra): a layer's product with a weight, e.g. an einsum.

    Under a setup that shards the weight over a batch axis (FSDP), the weight is gathered
    just before the product and gathered again in the backward pass instead of being
    kept (`tfllm.parallel.fsdp`); else this is `fn(x, w, *extra)`.

    Args:
      fn: the product; differentiable in every argument.
      x: the layer's input.
      w: the weight (a variable or its value).
      logical_axes: the weight's logical axes.
      name: used in error messages.
      extra: more inputs of `fn` (e.g. FP8 amax histories).
      equation, einsum: when `fn` is `einsum(equation, x, w, *extra)`, both: inside a
        block (`block_weights`) the product then runs per batch piece on the block's
        gathered weight (`tfllm.parallel.blocks`).
    """
    parallel = current()
    if parallel is None:
        return fn(x, w, *extra)
    return parallel.weight_product(fn, x, w, logical_axes, name, extra, equation, einsum)


def apply_weight(op, x, w, logical_axes: Sequence[Optional[str]], name: str = "weight"):
    """op(x, w) for a weight that broadcasts over x's trailing dimensions (a bias add, a
    norm's scale); x leads with (batch, length). Inside a block its gradient stays per
    device until the block's one reduction; else this is op(x, gather_weight(w))."""
    parallel = current()
    if parallel is None:
        return op(x, w)
    return parallel.apply_weight(op, x, w, logical_axes, name)


@contextlib.contextmanager
def block_weights(layer, x, gate=(), regather: bool = True):
    """The weights of `layer` (a transformer block, or a list of layers) move together
    inside: one gather at
    entry (waiting for `gate`, the previous block's input), one re-gather and one
    gradient reduction (`tfllm.parallel.blocks`). `regather=False` under full remat,
    whose recomputation already runs at backward time. A no-op outside a setup."""
    parallel = current()
    if parallel is None:
        yield
        return
    layers = list(layer) if isinstance(layer, (list, tuple)) else [layer]
    # Frozen weights (a LoRA kernel) travel in the block's gather too; only trainable
    # ones are reduced. FP8 amax histories are not weights.
    variables, seen = [], set()
    for v in (v for l in layers for v in l.weights):
        if id(v) not in seen and (v.trainable or getattr(v, "kind", "fp8_state") != "fp8_state"):
            seen.add(id(v))
            variables.append(v)
    block = parallel.block(variables, x, layers[0].compute_dtype, gate, regather,
                           name=layers[0].name)
    with fsdp.gate(gate), blocks.active(block):
        yield


def outside_block():
    """Inside: no block's gathered weights are used (a recomputed function reads its
    weights as variables; see `tfllm.models.common.remat`)."""
    return blocks.active(None)


@contextlib.contextmanager
def gather_after(tensors):
    """Weights gathered inside the block wait for `tensors` (the model passes the input of
    the block before, so each block's weights arrive one block ahead, not all at once)."""
    if current() is None:
        yield
        return
    with fsdp.gate(tensors):
        yield
