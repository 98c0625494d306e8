"""A block's weights move together: one gather, one re-gather, one gradient reduction.

Per-weight FSDP (`tfllm.parallel.fsdp`) gathers each weight on its own and lets DTensor
reduce each weight's gradient where the product that made it contracts the batch: ~50
collectives per block, half of them scalar all-reduces that order the gathers. On a GPU
hundreds of small NCCL calls are latency-bound; FSDP2 moves one flat buffer per block and
DDP reduces ~25 MB buckets. This module does the same on DTensor:

* **One flat gather per block.** At the block's entry every FSDP shard of the block is
  flattened on its device (reshape and transpose of the local shard only: the sharded
  dimension is split into (mesh size, rest) and its outer part moved first, which DTensor
  keeps local) and concatenated into one buffer per tensor-parallel signature, laid out
  `(fsdp, [model,] L)`; one relayout gathers it (16-bit weights as float16 bits, as in
  `fsdp`), and the weights are cut back out on the device.
* **Gradients stay per device until the block is done.** DTensor all-reduces an einsum's
  output as soon as it contracts a sharded dimension. So the block's products run "per
  batch piece": the activation's leading (batch, length) dimensions are split into
  (mesh size, rest) and the weight is broadcast to one copy per piece (a local slice:
  each device holds one copy, as it would the gathered weight). The weight's gradient is
  then a (pieces, *weight) tensor sharded like the pieces: a per-device partial sum, no
  collective. The block's operation (`tf.custom_gradient` over its shards) receives all
  partials at once, packs them into one float32 buffer and reduces it once: a
  reduce-scatter to the shards' layout for FSDP weights (all-reduce plus slice without
  NCCL), an all-reduce for replicated (data-parallel) weights, in buckets of at most
  `bucket_bytes`.
* **Re-gather once, one block ahead.** A product's backward pass asks its block for the
  weights again; the first one to ask (the block's last product) makes the block's
  re-gather after its incoming gradient and, at the same moment, the re-gather of the
  block before, so that block's weights travel while this block's backward computes.
* **Ordering without a global synchronization.** Gathers wait for a tensor by a data
  dependency (see `fsdp.zero_after`). Here the zero is made per device: the tensor's
  leading dimensions are split like the pieces and reduced locally to a (pieces,) zero
  laid out over the batch axes; it joins the shard buffer's bits where its axes are the
  buffer's (fsdp), so no collective is needed. Only an axis the buffer does not have
  (the data axis of a hybrid mesh) is reduced, one small int32 all-reduce.

Model code never sees any of it: `tfllm.parallel.context.weight_product` and
`apply_weight` ask the active block.
"""

from __future__ import annotations

import contextlib
import functools
import string
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfllm.parallel import fsdp

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20  # PyTorch DDP's default bucket_cap_mb


class Pieces:
    """How activations' leading (batch, length) dimensions split over mesh axes.

    Args:
      splits: ((dimension 0 or 1, mesh axis, size), ...) for the dimensions that are split.
    """

    def __init__(self, splits):
        self.splits = tuple(splits)
        self.axes = tuple(a for _, a, _ in self.splits)
        self.sizes = tuple(n for _, _, n in self.splits)

    def split(self, x):
        """x (B, T, ...) -> (n0, B/n0, [n1, T/n1,] ...): each piece on its own devices."""
        shape = x.shape.as_list()
        new = []
        for d in (0, 1):
            n = dict((dd, nn) for dd, _, nn in self.splits).get(d)
            new += [n, shape[d] // n] if n else [shape[d]]
        return tf.reshape(x, new + shape[2:])

    def piece_dims(self) -> List[int]:
        """Positions of the piece dimensions in a split tensor."""
        dims, pos = [], 0
        for d in (0, 1):
            if d in [dd for dd, _, _ in self.splits]:
                dims.append(pos)
                pos += 2
            else:
                pos += 1
        return dims

    def leading(self) -> int:
        """How many leading dimensions the split adds plus the two it replaces."""
        return 2 + len(self.splits)

    def pieces_first(self, x):
        """A split tensor with its piece dimensions moved to the front."""
        dims = self.piece_dims()
        rest = [i for i in range(x.shape.rank) if i not in dims]
        return tf.transpose(x, dims + rest)


class _Packing:
    """Flattens one weight (shard or full) into its slot of a block buffer and back."""

    def __init__(self, shape, spec, buffer_axes, mesh_sizes):
        self.shape, self.spec = list(shape), tuple(spec)
        split, outer_pos, inner_pos = [], {}, []
        for size, axis in zip(shape, spec):
            if axis:
                n = mesh_sizes[axis]
                outer_pos[axis] = len(split)
                split += [n, size // n]
                inner_pos.append(len(split) - 1)
            else:
                split.append(size)
                inner_pos.append(len(split) - 1)
        self.split = split
        self.perm = [outer_pos[a] for a in buffer_axes] + inner_pos
        self.outer = [mesh_sizes[a] for a in buffer_axes]
        self.inner = [split[i] for i in inner_pos]
        self.length = int(np.prod(self.inner)) if self.inner else 1
        self.inverse = list(np.argsort(self.perm))

    def pack(self, t, lead: int = 0):
        """t (*lead, *shape) -> (*lead, *outer, length)."""
        lead_shape = t.shape.as_list()[:lead]
        t = tf.reshape(t, lead_shape + self.split)
        t = tf.transpose(t, list(range(lead)) + [lead + p for p in self.perm])
        return tf.reshape(t, lead_shape + self.outer + [self.length])

    def unpack(self, buf):
        """(*outer, length) -> the weight's (global) shape; inverse of `pack`."""
        t = tf.reshape(buf, self.outer + self.inner)
        t = tf.transpose(t, self.inverse)
        return tf.reshape(t, self.shape)


class Block:
    """The weights of one block call under a mesh: gathered together, reduced together.

    Args:
      parallel: the `tfllm.parallel.placement.Parallel` setup.
      variables: the block's weights (Keras variables); frozen ones (not trainable) are
        gathered with the others but get no gradient and no reduction.
      pieces: how its activations split (`Pieces`).
      compute_dtype: the dtype float weights are used in (Keras autocast).
      gate: tensors (batch-leading) the forward gather waits for, or ().
      previous: the block run before this one (its re-gather is prefetched), or None.
      regather: gather again in the backward pass (False under full remat, whose
        recomputation already gathers at backward time).
      bucket_bytes: largest float32 gradient buffer all-reduced at once (replicated
        weights; a block's FSDP shards are reduce-scattered in one buffer).
      name: names the block's collectives in the graph (`<name>_gather`, `_regather`,
        `_reduce`), so that cost reports and tests can tell blocks apart.
    """

    def __init__(self, parallel, variables, pieces: Pieces, compute_dtype, gate=(),
                 previous: Optional["Block"] = None, regather: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, name: str = "block"):
        self.parallel, self.pieces, self.name = parallel, pieces, name
        self.previous, self.regather, self.bucket_bytes = previous, regather, bucket_bytes
        self.mesh_sizes = dict(parallel.shape)
        batch_axes = parallel.batch_mesh_axes
        self.variables = list(variables)
        self.index: Dict[int, int] = {id(v): i for i, v in enumerate(self.variables)}
        self.frozen = [not v.trainable for v in self.variables]
        self.shard_specs, self.compute_specs, self.dtypes = [], [], []
        for v in self.variables:
            spec = parallel.variable_spec(v)
            self.shard_specs.append(spec)
            self.compute_specs.append(tuple(None if m in batch_axes else m for m in spec))
            autocast = getattr(v, "autocast", True) and tf.as_dtype(v.dtype).is_floating
            self.dtypes.append(tf.as_dtype(compute_dtype if autocast else v.dtype))
        # Weights that travel quantized (FP8 projections' kernels, `_gather_coded`): only
        # those gathered by a real gather, which copies the carriers' bits.
        self.codecs = [getattr(v, "gather_codec", None) for v in self.variables]
        # Buffers: one per (gathered axes, tensor-parallel axes, dtype) signature; coded
        # weights get buffers of their own ("codes").
        self.groups: Dict[Tuple, List[int]] = {}
        for i, spec in enumerate(self.shard_specs):
            gathered = tuple(m for m in spec if m and m in batch_axes)
            kept = tuple(m for m in spec if m and m not in batch_axes)
            if not (gathered and fsdp.gathers_as_collective()):
                self.codecs[i] = None
            kind = "codes" if self.codecs[i] is not None else self.dtypes[i]
            self.groups.setdefault((gathered, kept, kind), []).append(i)
        self.packings = {}
        for (gathered, kept, _), members in self.groups.items():
            for i in members:
                self.packings[i] = _Packing(self.variables[i].shape, self.shard_specs[i],
                                            gathered + kept, self.mesh_sizes)
        self._values = None
        self._batched = None
        self._scales: Dict[int, tf.Tensor] = {}  # coded weights: their quantization scale
        self._amax: Dict[int, tf.Tensor] = {}  # coded weights: their amax (whole weight)
        self._again: Optional[List] = None
        self._gate = tuple(t for t in gate if t is not None)
        self.graph = None  # the graph the block was entered in

    # ---- layouts -----------------------------------------------------------------------
    def _layout(self, spec):
        return dtensor.Layout([m or dtensor.UNSHARDED for m in spec], self.parallel.mesh)

    def _batched_layout(self, i):
        return self._layout(self.pieces.axes + self.compute_specs[i])

    # ---- the forward operation ---------------------------------------------------------
    def enter(self):
        """Gathers the block's weights (one op over all shards); call once at entry."""
        values = [tf.cast(v.value, d) if v.dtype != d else tf.convert_to_tensor(v.value)
                  for v, d in zip(self.variables, self.dtypes)]
        zero = self._local_zero(self._gate) if self._gate else None
        self.graph = values[0].graph if values and hasattr(values[0], "graph") else None
        with tf.name_scope(f"{self.name}_scales"):
            self._coded_scales(values)

        @tf.custom_gradient
        def op(*shards):
            self._values = shards
            with tf.name_scope(f"{self.name}_gather"):
                batched = self._gather(shards, zero, first=True)

            def grad(*dys):
                with tf.name_scope(f"{self.name}_reduce"):
                    return self._reduce(dys, shards)

            return batched, grad

        self._batched = list(op(*values))
        return self

    def batched(self, var):
        """`var` as a (pieces, *weight) tensor, or None if not in this block."""
        i = self.index.get(id(var))
        return None if i is None else self._batched[i]

    def amax(self, var):
        """The whole weight's amax of a coded `var` (its gathered values are quantized,
        their own amax is clipped), or None."""
        i = self.index.get(id(var))
        return None if i is None else self._amax.get(i)

    def again(self, var, after):
        """`var` gathered again for the backward pass, after tensor `after` exists; the
        block before is gathered at the same moment (prefetch)."""
        i = self.index[id(var)]
        if not self.regather:
            return self._batched[i]
        if self._again is None:
            zero = self._local_zero([after])
            with tf.name_scope(f"{self.name}_regather"):
                self._again = self._gather(self._values, zero)
            before = self.previous
            if before is not None and before.regather and before._again is None \
                    and before._values is not None:
                with tf.name_scope(f"{before.name}_regather"):
                    before._again = before._gather(before._values, zero)
        return self._again[i]

    def _gather(self, shards, zero, first=False):
        """The full weights as (pieces, *weight) tensors, one gather per buffer."""
        out = [None] * len(self.variables)
        for (gathered, kept, kind), members in self.groups.items():
            if kind == "codes":
                fulls = self._gather_coded(gathered, kept, members, shards, zero, first)
            elif gathered:
                fulls = self._gather_group(gathered, kept, members, shards, zero)
            else:
                fulls = [shards[i] for i in members]
            for i, full in zip(members, fulls):
                out[i] = self._broadcast(i, full)
        return out

    def _gather_group(self, gathered, kept, members, shards, zero):
        dtype = shards[members[0]].dtype
        as_bits = fsdp.moves_as_float16(dtype)
        parts = []
        for i in members:
            parts.append(self.packings[i].pack(shards[i]))
        buf = tf.concat(parts, axis=-1) if len(parts) > 1 else parts[0]
        axes = gathered + kept
        if zero is not None:
            buf = self._or_zero(buf, zero, axes)
        target = self._layout((None,) * len(gathered) + kept + (None,))
        if as_bits:
            full = tf.bitcast(dtensor.relayout(tf.bitcast(buf, tf.float16), target), dtype)
        else:
            full = dtensor.relayout(buf, target)
        out, offset = [], 0
        for i in members:
            p = self.packings[i]
            piece = full[..., offset:offset + p.length]
            offset += p.length
            w = p.unpack(piece)
            out.append(w)
        return out

    # ---- weights that travel quantized ---------------------------------------------------
    def _local_amax(self, i, shard):
        """amax of each device's part of a weight: (*outer,) laid out like the buffer's
        leading dimensions, without a collective."""
        packed = self.packings[i].pack(tf.stop_gradient(shard))
        return tf.reduce_max(tf.abs(tf.cast(packed, tf.float32)), axis=-1)

    def _coded_scales(self, values):
        """The quantization scale of every coded weight, and under current scaling its
        amax: one all-reduce (max) per buffer, as FSDP2's float8 all-gather does."""
        for (_, _, kind), members in self.groups.items():
            if kind != "codes":
                continue
            codecs = [self.codecs[i] for i in members]
            if any(c.needs_amax for c in codecs):
                local = tf.stack([self._local_amax(i, values[i]) for i in members], -1)
                amax = tf.reduce_max(local, axis=list(range(local.shape.rank - 1)))
                for k, i in enumerate(members):
                    self._amax[i] = amax[k]
            for i, codec in zip(members, codecs):
                self._scales[i] = tf.stop_gradient(codec.scale(self._amax.get(i)))

    def _gather_coded(self, gathered, kept, members, shards, zero, first):
        """Coded weights gathered as bytes, two per float16 carrier, and decoded on the
        device (the codec: `tfllm.precision.fp8.WeightCodec`). The first gather of a step
        also carries each device's amax (float32 as two carriers) where the scale did
        not need it, so the history sees the whole weight's amax without a collective of
        its own."""
        codes, lengths = [], []
        for i in members:
            packed = self.packings[i].pack(shards[i])
            codes.append(self.codecs[i].encode(packed, self._scales[i]))
            lengths.append(self.packings[i].length)
        codes = tf.concat(codes, axis=-1) if len(codes) > 1 else codes[0]
        total = sum(lengths)
        if total % 2:
            codes = tf.pad(codes, [[0, 0]] * (codes.shape.rank - 1) + [[0, 1]])
        parts = [fsdp.bytes_to_carriers(codes)]
        carried = [i for i in members if first and i not in self._amax]
        if carried:
            amax = tf.stack([self._local_amax(i, shards[i]) for i in carried], -1)
            parts.append(fsdp.float32_to_carriers(amax))
        buf = tf.concat(parts, axis=-1) if len(parts) > 1 else parts[0]
        axes = gathered + kept
        if zero is not None:
            buf = self._or_zero(buf, zero, axes)
        full = dtensor.relayout(buf, self._layout((None,) * len(gathered) + kept + (None,)))
        n_carriers = parts[0].shape[-1]
        if carried:
            per_device = fsdp.carriers_to_float32(full[..., n_carriers:])  # (*outer, n)
            amax = tf.reduce_max(per_device, axis=list(range(per_device.shape.rank - 1)))
            for k, i in enumerate(carried):
                self._amax[i] = amax[k]
        all_codes = fsdp.carriers_to_bytes(full[..., :n_carriers])
        out, offset = [], 0
        for i, length in zip(members, lengths):
            piece = all_codes[..., offset:offset + length]
            offset += length
            w = self.codecs[i].decode(piece, self._scales[i], self.dtypes[i])
            out.append(self.packings[i].unpack(w))
        return out

    def _broadcast(self, i, w):
        """w (full compute layout) -> (pieces, *w): one copy per piece, a local slice."""
        if not self.pieces.splits:
            return w
        shape = list(self.pieces.sizes) + w.shape.as_list()
        wb = tf.broadcast_to(tf.reshape(w, [1] * len(self.pieces.sizes) + w.shape.as_list()),
                             shape)
        return dtensor.relayout(wb, self._batched_layout(i))

    # ---- ordering ----------------------------------------------------------------------
    def _local_zero(self, tensors):
        """An int32 zero per piece, laid out over the piece axes, made from `tensors`
        without a collective (see the module docstring)."""
        zeros = []
        for t in tensors:
            t = tf.stop_gradient(tf.convert_to_tensor(t))
            if t.shape.rank is None or t.shape.rank < 2 or not self.pieces.splits:
                return None
            s = self.pieces.pieces_first(self.pieces.split(t))
            k = len(self.pieces.splits)
            total = tf.reduce_sum(tf.cast(s, tf.float32), axis=list(range(k, s.shape.rank)))
            zeros.append(total)
        total = tf.add_n(zeros) if len(zeros) > 1 else zeros[0]
        return tf.bitwise.bitwise_and(tf.bitcast(total, tf.int32), tf.constant(0, tf.int32))

    def _or_zero(self, buf, zero, axes):
        """buf with `zero`'s bits ORed in: buf now waits for the tensors zero came from."""
        z = zero
        keep = [a for a in self.pieces.axes if a in axes]
        drop = [k for k, a in enumerate(self.pieces.axes) if a not in axes]
        if drop:  # an axis the buffer is replicated over: one small int32 all-reduce
            z = tf.reduce_sum(z, axis=drop)
        # z is laid out over `keep` (in pieces order); place it on the buffer's dims.
        order = [keep.index(a) for a in axes if a in keep]
        if order != list(range(len(order))):
            z = tf.transpose(z, order)
        shape = [self.mesh_sizes[a] if a in keep else 1 for a in axes] + [1]
        return fsdp._after(buf, tf.reshape(z, shape))

    # ---- the backward reduction --------------------------------------------------------
    def _reduce(self, dys, shards):
        """Per-device partial gradients (pieces, *weight) -> shard gradients, one float32
        reduction per buffer (in buckets of at most `bucket_bytes`)."""
        grads = [None] * len(self.variables)
        lead = len(self.pieces.splits)
        for (gathered, kept, _), members in self.groups.items():
            members = [i for i in members if not self.frozen[i]]
            # FSDP shards: the block's one reduce-scatter (FSDP2's), whatever its size;
            # replicated (data-parallel) gradients: all-reduces of at most bucket_bytes.
            for bucket in (self._buckets(members) if not gathered else
                           [members] if members else []):
                parts = []
                for i in bucket:
                    dy = dys[i]
                    if dy is None:
                        dy = tf.zeros(list(self.pieces.sizes) + self.variables[i].shape.as_list(),
                                      tf.float32)
                    parts.append(self.packings[i].pack(tf.cast(dy, tf.float32), lead=lead))
                buf = tf.concat(parts, axis=-1) if len(parts) > 1 else parts[0]
                if lead:
                    buf = tf.reduce_sum(buf, axis=list(range(lead)))
                shard_layout = self._layout(gathered + kept + (None,))
                reduced = dtensor.relayout(buf, shard_layout)
                if gathered and fsdp._sliced_reduction(shard_layout):
                    reduced = fsdp._copy(reduced)
                offset = 0
                for i in bucket:
                    p = self.packings[i]
                    piece = reduced[..., offset:offset + p.length]
                    offset += p.length
                    grads[i] = tf.cast(p.unpack(piece), shards[i].dtype)
        return grads

    def _buckets(self, members):
        return fill_in_order(members, lambda i: 4 * int(np.prod(self.variables[i].shape)),
                             self.bucket_bytes)


def fill_in_order(items, size_of, limit):
    """`items` in order, cut into runs where the next item would take a run's summed
    `size_of` past `limit` (an item larger than the limit gets a run of its own): FSDP's
    reduction buckets, and the shards of a Hugging Face export (as transformers cuts them).
    """
    runs, current, size = [], [], 0
    for item in items:
        n = size_of(item)
        if current and size + n > limit:
            runs.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        runs.append(current)
    return runs


def piece_letters(equation: str, count: int) -> str:
    """`count` einsum letters the equation does not use."""
    free = [c for c in string.ascii_lowercase[::-1] if c not in equation]
    return "".join(free[:count])


def batched_equation(equation: str, pieces: Pieces) -> Optional[str]:
    """The einsum of `equation` run per piece: x's and y's leading (batch, length) letters
    each get a piece letter before them and the weight gets the piece letters first;
    None when x and y do not start with the same two letters."""
    inputs, y = equation.split("->")
    x, w = inputs.split(",")
    if len(x) < 2 or len(y) < 2 or x[:2] != y[:2] or x[0] in w or x[1] in w:
        return None
    letters = piece_letters(equation, len(pieces.splits))
    split_dims = [d for d, _, _ in pieces.splits]
    it = iter(letters)

    def lead(s):
        out = ""
        for d in (0, 1):
            out += (next(it) if d in split_dims else "") + s[d]
        return out

    it = iter(letters)
    x2 = lead(x) + x[2:]
    it = iter(letters)
    y2 = lead(y) + y[2:]
    return f"{x2},{letters}{w}->{y2}"


# ---- the active block (per thread, like `fsdp`'s gate) ------------------------------------
_state = threading.local()


def current() -> Optional[Block]:
    return getattr(_state, "block", None)


def last() -> Optional[Block]:
    """The block entered last in this forward pass (the next one's `previous`)."""
    return getattr(_state, "last", None)


@contextlib.contextmanager
def active(block: Optional[Block]):
    """Makes `block` (entered) the one products and weight ops ask, for the duration."""
    previous = current()
    _state.block = block
    if block is not None:
        _state.last = block
    try:
        yield block
    finally:
        _state.block = previous


def product(block: Block, var, equation: str, einsum, x, extra=()):
    """einsum(equation, x, var, *extra) run per piece, or None when the block cannot
    (the weight is not its own, or the equation does not lead with batch and length).
    A frozen weight gets no gradient (none is computed)."""
    wb = block.batched(var)
    eq = batched_equation(equation, block.pieces) if wb is not None else None
    if eq is None:
        return None
    pieces = block.pieces
    frozen = block.frozen[block.index[id(var)]]
    amax = block.amax(var)
    if amax is not None:  # the weight arrived quantized: its einsum takes the true amax
        einsum = functools.partial(einsum, w_amax=amax)
    if getattr(einsum, "per_piece_amax", False) or amax is not None:
        # an FP8 einsum: amaxes collected for the step keep one value per piece (device)
        einsum = functools.partial(einsum, piece_dims=(
            tuple(pieces.piece_dims()), tuple(range(len(pieces.splits)))))

    @tf.custom_gradient
    def op(x, wb, *extra):
        shape = x.shape.as_list()
        y5 = einsum(eq, pieces.split(x), wb, *extra)
        out_shape = shape[:2] + y5.shape.as_list()[pieces.leading():]

        def grad(dy):
            w_again = block.again(var, dy)
            x5 = pieces.split(x)
            wrt = [x5, *extra] if frozen else [x5, w_again, *extra]
            with tf.GradientTape() as tape:
                tape.watch(wrt)
                y_again = einsum(eq, x5, w_again, *extra)
            grads = tape.gradient(y_again, wrt, output_gradients=tf.reshape(dy, y_again.shape))
            if frozen:
                grads = [grads[0], None, *grads[1:]]
            return (tf.reshape(grads[0], shape), grads[1], *grads[2:])

        return tf.reshape(y5, out_shape), grad

    return op(tf.convert_to_tensor(x), wb, *(tf.convert_to_tensor(t) for t in extra))


def apply(block: Block, op, x, var):
    """op(x, w) for a weight that broadcasts over x's trailing dimensions (a bias, a norm
    scale), run per piece so its gradient stays per device; None if not the block's."""
    wb = block.batched(var)
    if wb is None or not block.pieces.splits:
        return None
    x5 = block.pieces.split(tf.convert_to_tensor(x))
    rank, wrank = x5.shape.rank, len(var.shape)
    target = [1] * rank
    for pos, n in zip(block.pieces.piece_dims(), block.pieces.sizes):
        target[pos] = n
    target[rank - wrank:] = var.shape
    return tf.reshape(op(x5, tf.reshape(wb, target)), x.shape)
