"""Pictures of where each device's block of a tensor lives (`tfllm layouts --plot`).

Nothing here decides a layout: the specs come from the rules table (`layouts.layout_rows`,
`rules.token_batch_spec`), and each device's block from its coordinates on the mesh,
as DTensor places shards (`device_blocks`; equal to `placement.local_blocks` on a real
mesh, which tests/parallel/test_plot.py checks). Every picture colours by device: the
same colour is the same device in the mesh panel and in every tensor, and a block held by
several devices (replicated over a mesh axis) is striped with all of their colours.
"""

from __future__ import annotations

import io
import itertools
import math
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfllm import files
from tfllm.parallel.rules import shard_shape, spec_to_str, token_batch_spec

Block = Tuple[Tuple[int, ...], Tuple[int, ...]]


def device_coordinates(mesh_shape: Mapping[str, int]) -> List[Dict[str, int]]:
    """Each device's {axis: index}, devices numbered row-major over the mesh axes (the
    order DTensor's `create_mesh` gives them)."""
    names = list(mesh_shape)
    return [dict(zip(names, loc))
            for loc in itertools.product(*(range(mesh_shape[n]) for n in names))]


def device_blocks(shape: Sequence[int], spec: Sequence[Optional[str]],
                  mesh_shape: Mapping[str, int]) -> Dict[Block, List[int]]:
    """{(start, size): [devices holding that block]} of a `shape` tensor laid out by
    `spec` (a mesh axis or None per dimension)."""
    size = shard_shape(shape, spec, mesh_shape)
    held: Dict[Block, List[int]] = {}
    for device, loc in enumerate(device_coordinates(mesh_shape)):
        start = tuple(loc[m] * s if m else 0 for m, s in zip(spec, size))
        held.setdefault((start, size), []).append(device)
    return held


def device_colour(device: int, count: int):
    import matplotlib
    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20" if count <= 20 else "hsv"]
    return cmap(device % cmap.N if count <= 20 else device / count)


def draw_mesh(ax, mesh_shape: Mapping[str, int]) -> None:
    """The devices at their mesh coordinates: the last axis across, the one before down,
    a third axis as groups side by side."""
    from matplotlib.patches import Rectangle
    names, count = list(mesh_shape), math.prod(mesh_shape.values())
    sizes = [mesh_shape[n] for n in names]
    cols, rows = sizes[-1], (sizes[-2] if len(names) > 1 else 1)
    for device, loc in enumerate(device_coordinates(mesh_shape)):
        group = loc[names[0]] if len(names) > 2 else 0
        x = group * (cols + 0.6) + loc[names[-1]]
        y = loc[names[-2]] if len(names) > 1 else 0
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=device_colour(device, count),
                               edgecolor="0.2"))
        ax.text(x + 0.45, y + 0.45, str(device), ha="center", va="center", fontsize=10,
                color="white", fontweight="bold")
    groups = sizes[0] if len(names) > 2 else 1
    ax.set_xlim(-0.2, groups * (cols + 0.6) - 0.4)
    ax.set_ylim(max(rows, 2) + 0.1, -0.2)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    where = f"{names[-1]} across" + (f", {names[-2]} down" if len(names) > 1 else "")
    if len(names) > 2:
        where += f"\n{names[0]}: groups"
    ax.set_title("mesh " + ", ".join(f"{n}={s}" for n, s in zip(names, sizes)), fontsize=10)
    ax.set_xlabel(where, fontsize=9)


def draw_tensor(ax, title: str, shape: Sequence[int], spec: Sequence[Optional[str]],
                logical_axes: Sequence[Optional[str]], mesh_shape: Mapping[str, int]) -> None:
    """A tensor as its first dimension by the others flattened, drawn to its real shape
    (aspect ratio), one rectangle per block in its device's colour; a replicated block is
    striped with the colours of every device holding it."""
    from matplotlib.patches import Rectangle
    if any(m is not None for m in spec[2:]):
        raise ValueError(f"{title}: only the first two dimensions may be drawn sharded; "
                         f"the spec is {spec_to_str(spec)}.")
    count = math.prod(mesh_shape.values())
    inner = math.prod(shape[2:]) if len(shape) > 2 else 1
    height = shape[0]
    width = (shape[1] if len(shape) > 1 else 1) * inner
    for (start, size), devices in sorted(device_blocks(shape, spec, mesh_shape).items()):
        x = start[1] * inner if len(shape) > 1 else 0
        w = size[1] * inner if len(shape) > 1 else 1
        stripe = w / len(devices)
        for k, device in enumerate(devices):
            ax.add_patch(Rectangle((x + k * stripe, start[0]), stripe, size[0],
                                   facecolor=device_colour(device, count), linewidth=0))
        ax.add_patch(Rectangle((x, start[0]), w, size[0], fill=False, edgecolor="0.1",
                               linewidth=1.2))
        if len(devices) > 1:
            label = "all" if len(devices) == count else f"x{len(devices)}"
            ax.text(x + w / 2, start[0] + size[0] / 2, label, ha="center", va="center",
                    fontsize=9, bbox=dict(facecolor="white", edgecolor="none", pad=1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_aspect("equal" if max(height, width) <= 8 * min(height, width) else "auto")
    ax.set_xticks([0, width])
    ax.set_yticks([0, height])
    ax.tick_params(labelsize=9)
    ax.set_title(f"{title}\n{spec_to_str(spec)}", fontsize=10)
    ax.set_xlabel(" x ".join(a or "-" for a in logical_axes[1:]) or "-", fontsize=9)
    ax.set_ylabel(logical_axes[0] or "-", fontsize=9)


#: what `plot_layouts` draws by default: (title, variable path below the model's name)
DEFAULT_WEIGHTS = (("attention query", "block_0/attention/query/kernel"),
                   ("MLP up", "block_0/mlp/up/kernel"),
                   ("token embedding", "token_embedding/embeddings"))


def plot_layouts(rows, mesh_shape: Mapping[str, int], rules,
                 weights: Sequence[Tuple[str, str]] = DEFAULT_WEIGHTS,
                 batch_shape: Optional[Sequence[int]] = None, path: Optional[str] = None):
    """The mesh, chosen weights and the token batch, coloured by device.

    Args:
      rows: `layouts.layout_rows(...)` of the model.
      mesh_shape: {axis: size}.
      rules: the rules table (for the token batch's layout).
      weights: (title, path suffix) of the weights to draw.
      batch_shape: (rows, tokens) of a global batch to draw, or None.
      path: write the figure there (PNG at 110 dpi, or SVG by its extension).

    Returns:
      The matplotlib figure.
    """
    by_path = {}
    for suffix_title, suffix in weights:
        match = [r for r in rows if r.path.endswith("/" + suffix) or r.path == suffix]
        if not match:
            raise ValueError(f"no variable ends with {suffix}; the model has e.g. "
                             f"{[r.path for r in rows[:3]]}")
        by_path[suffix_title] = match[0]
    panels = 1 + len(by_path) + (batch_shape is not None)
    # Written to a file: a bare Figure, so the caller's backend and pyplot's open figures
    # stay as they were. Drawn for a notebook: through pyplot, which shows it inline.
    if path is not None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(2.6 * panels + 0.6, 3.2), dpi=110)
    else:
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(2.6 * panels + 0.6, 3.2), dpi=110)
    axes = fig.subplots(1, panels, gridspec_kw={"width_ratios": [1.3] + [1] * (panels - 1)})
    draw_mesh(axes[0], mesh_shape)
    for ax, (title, row) in zip(axes[1:], by_path.items()):
        draw_tensor(ax, title, row.shape, row.spec, row.logical_axes, mesh_shape)
    if batch_shape is not None:
        spec = token_batch_spec(tuple(batch_shape), rules, mesh_shape)
        draw_tensor(axes[-1], "token batch", tuple(batch_shape), spec,
                    ("activation_batch", "activation_length"), mesh_shape)
    fig.tight_layout()
    if path is not None:  # drawn in memory, written whole, never through a link
        image = io.BytesIO()
        fig.savefig(image, dpi=110, format=os.path.splitext(path)[1][1:] or "png")
        path = os.path.abspath(path)
        files.write_atomically(os.path.dirname(path), path, image.getvalue())
    return fig
