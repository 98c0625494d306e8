"""The collectives of a sharded plan, measured on the executed CPU program of the same mesh.

`tfllm.plan.sharded` assumes what a layout should communicate; this module reads what
DTensor really executes (`tfllm.compiler.costs`) and scales it to the real model:

1. **Run.** The config's model is rebuilt at a tiny scale (same family, mesh axes, rules,
   precision policy, batch rows and gradient accumulation; 1 and then 2 layers; small
   dimensions that divide the mesh) and one train step runs on a CPU mesh with as many
   logical devices, in a child process (the planning process may already have started
   TensorFlow with one device). The busiest device's collectives are kept.
2. **Classify.** Each collective's element count names what it carries. The tiny
   dimensions are chosen so that the weight kinds have distinct sizes (hidden H = 24 x
   the largest mesh axis; query and output H x H, key and value H x H or H x H/2 under grouped
   queries, MLP 3 H x H, vocabulary 5 H x H): a count equal to a weight's compute-layout
   size (its shard over the non-fsdp axes: what a gather yields and a gradient
   reduction carries) is that weight; a multiple of the device's micro-batch tokens is an
   activation (tokens x width); up to 1024 elements (DTensor's padding unit) is small
   (scalars, norm-scale gradients); anything else is a merged gradient buffer. Op names
   cannot do this: the backward ops of a custom gradient lose their name scope.
3. **Scale.** Weights by the real weight's element count over the tiny one's; activations
   by the real micro-batch tokens over the tiny ones and the real hidden width over the
   tiny one; merged buffers by the real model's compute-layout parameters over the tiny
   ones (both at the tiny layer count); small ones by the hidden width (an upper bound).
   Then every figure is extrapolated over layers from the 1- and 2-layer runs
   (a + b x layers: exact for what is per layer and what is not).
4. **Bytes and time** with ring algorithms per kind (all-gather and reduce-scatter
   (n-1)/n, all-reduce 2(n-1)/n of the buffer). A float32 weight-gradient all-reduce over
   the fsdp group is counted as the reduce-scatter it is under NCCL (DTensor decomposes a
   reduce-scatter into all-reduce + slice only without NCCL, `LowerReduceScatterOp`).

Known limits: key/value gathers of a sequence split scale with the hidden width (an
overestimate for grouped queries); collectives inside loops are counted once.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Optional

from tfllm import files
from tfllm.footprint.layout import mesh_plan, per_device_config

PADDING = 1024  # DTensor pads merged all-reduce buffers to multiples of this
_RING = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}
BASIS = ("measured: the executed CPU program of this mesh at a tiny scale "
         "(tfllm.compiler.costs), scaled to this model")
CLUSTERS_BASIS = ("measured: XLA clusters of the busiest device in DTensor's executed program "
                  "of this mesh (jit_compile, CPU devices, the model's family at tiny widths, "
                  "1 and 2 layers), a + b x layers")


#: The most logical CPU devices a tiny step runs on. A wider mesh is measured on a proxy
#: (`proxy_shape`): llama-70b's tiny step on 128 devices needed over 157,000 memory
#: mappings and 21 GB of host memory and did not finish (benchmarks/results/h100_plan.md).
MAX_DEVICES = 32


class MeasureError(RuntimeError):
    """The tiny step could not be run or its collectives not mapped (the message says why)."""


def tiny_config(config, layers: int, shape: Dict[str, int]):
    """The config at a tiny scale on the same mesh (see the module docstring).

    Args:
      config: the real config.
      layers: the tiny model's layer count.
      shape: the mesh shape ({"fsdp": 8}).
    """
    tp = shape.get("model", 1)
    m = config.model
    grouped = (m.num_key_value_heads or m.num_query_heads) < m.num_query_heads
    hidden = tiny_width(shape)
    kv_heads = tp
    query_heads = kv_heads * (2 if grouped else 1)
    t = copy.deepcopy(config)
    t.mesh.axes = ",".join(f"{k}={v}" for k, v in shape.items())
    tm = t.model
    tm.num_layers = layers
    tm.hidden_dim = hidden
    tm.num_query_heads = query_heads
    tm.num_key_value_heads = kv_heads
    tm.head_dim = hidden // query_heads
    tm.intermediate_dim = 3 * hidden
    tm.vocab_size = 5 * hidden
    tm.attention_chunk = 0
    length = 16
    tm.max_sequence_length = length
    t.data.sequence_length = length
    t.data.source = "synthetic"
    t.train.jit_compile = True  # as on GPUs: DTensor hands XLA one cluster per piece
    # Blocks reduce their gradients in buckets of at most mesh.gradient_bucket_mb: a
    # real block spans many buckets (llama-7b's 202M parameters: one per weight at 25 MiB),
    # a tiny one a single bucket. The bucket shrinks with the block, so that the tiny step
    # splits its reductions as the real one does (collectives, and the clusters between).
    t.mesh.gradient_bucket_mb = config.mesh.gradient_bucket_mb * (
        _largest_block(t, shape) / _largest_block(config, shape))
    return t


def tiny_width(shape: Dict[str, int]) -> int:
    """The tiny model's hidden width on a mesh: 24 x the largest mesh axis. DTensor
    splits a tensor dimension over one mesh axis at most, so every width and vocabulary
    of the tiny model (multiples of it) divides over any axis that splits it; 24 x the
    device count (as before) made llama-70b's fsdp=16,model=8 tiny model 3,072 wide,
    about 200M parameters per layer, more than this 23 GiB host could run on 128 CPU
    devices."""
    return 24 * max(shape.values())


def _largest_block(config, shape) -> int:
    """Elements the largest transformer block reduces on one device."""
    return max(u.reduced for u in mesh_plan(config, math.prod(shape.values())).units
               if u.name not in ("token_embedding", "final_norm + head"))


def _kind(path: str) -> str:
    return re.sub(r"block_\d+", "block", path)


def group_sizes(proxy: Dict[str, int], shape: Dict[str, int]) -> Optional[Dict[int, int]]:
    """{devices in a group on `proxy`: devices in the same group on `shape`} for every set
    of mesh axes a collective can span, or None when two sets that differ on `shape` have
    one size on `proxy` (a collective's group would not say which axes it spans)."""
    out: Dict[int, int] = {}
    axes = list(shape)
    for r in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, r):
            p, real = (math.prod(m[a] for a in subset) for m in (proxy, shape))
            if out.setdefault(p, real) != real:
                return None
    return out


def proxy_shape(shape: Dict[str, int]) -> Optional[Dict[str, int]]:
    """A mesh of at most `MAX_DEVICES` on which a device runs the program of `shape`'s,
    or None when `shape` is that small already (or no proxy tells its groups apart).

    Only the axes that split the batch (data, fsdp) shrink, each to a divisor of its size:
    a device then holds the same compute-layout weights (their shard over the other axes),
    gathers and reduces the same buffers and, with the global batch shrunk alike, the
    same rows; only the collectives' group sizes differ, and `scaled_collectives` counts
    each at its group on `shape` (`group_sizes`). The smallest such mesh is taken.
    """
    if math.prod(shape.values()) <= MAX_DEVICES:
        return None
    axes = [a for a in ("data", "fsdp") if shape.get(a, 1) > 2]
    best = None
    for sizes in itertools.product(*[[d for d in range(2, shape[a]) if shape[a] % d == 0]
                                     for a in axes]):
        proxy = dict(shape, **dict(zip(axes, sizes)))
        devices = math.prod(proxy.values())
        if devices <= MAX_DEVICES and group_sizes(proxy, shape) is not None and (
                best is None or devices < math.prod(best.values())):
            best = proxy
    return best


def proxy_config(config, shape: Dict[str, int], proxy: Dict[str, int]):
    """`config` on the `proxy` mesh, its global batch shrunk with the batch axes so that a
    device's rows stay the same.

    Raises:
      MeasureError: the batch does not shrink to the same rows per device.
    """
    shrink = math.prod(shape.values()) // math.prod(proxy.values())
    p = copy.deepcopy(config)
    p.mesh.axes = ",".join(f"{k}={v}" for k, v in proxy.items())
    p.train.global_batch_size = config.train.global_batch_size // shrink
    if (config.train.global_batch_size % shrink
            or _micro_tokens(p, proxy) != _micro_tokens(config, shape)):
        raise MeasureError(f"the proxy mesh {p.mesh.axes} of {config.mesh.axes} does not "
                           "give a device the same rows; plan with --collectives assumed")
    return p


def _micro_tokens(config, shape) -> int:
    local, _ = per_device_config(config, math.prod(shape.values()))
    return (local.train.global_batch_size // config.train.grad_accum_steps
            * local.data.sequence_length)


def scales(config, tiny, shape) -> dict:
    """How each class of the tiny program's collectives scales to the real model.

    Returns {"weights": {elements: (kind, scale)}, "tokens": tiny micro tokens,
    "activation": scale of tokens x width, "token": scale of tokens, "merged", "small"}.

    Raises:
      MeasureError: two weight kinds of the tiny model share a size but not a scale.
    """
    real = copy.deepcopy(config)
    real.model.num_layers = tiny.model.num_layers
    devices = math.prod(shape.values())
    tiny_plan, real_plan = mesh_plan(tiny, devices), mesh_plan(real, devices)
    tiny_sizes, real_sizes = tiny_plan.compute_sizes(), real_plan.compute_sizes()
    weights: Dict[int, tuple] = {}
    for path, n in tiny_sizes.items():
        s = real_sizes[path] / n
        kind = _kind(path)
        if n in weights and not math.isclose(weights[n][1], s):
            raise MeasureError(f"the tiny model's {kind} and {weights[n][0]} both have "
                               f"{n} elements but scale differently")
        weights.setdefault(n, (kind, s))
    # A weight split over `model` can also travel whole: the embedding's gradient is
    # summed over the whole vocabulary (UnsortedSegmentSum) and reduced over fsdp. Its
    # count is a multiple of the tokens too, and scaled as an activation it followed the
    # tiny width (fsdp=8,model=2 against its fsdp=4 proxy: 3 times apart)
    real_full = real_plan.full_sizes()
    for path, n in tiny_plan.full_sizes().items():
        if path.endswith("embeddings"):  # only the lookup's gradient is summed whole
            weights.setdefault(n, (_kind(path) + " (whole)", real_full[path] / n))
    # A block's weights travel and are reduced as one buffer (tfllm.parallel.blocks): its
    # sharded kernels together, its replicated norms apart (or with the kernels when
    # nothing is sharded); the final norm and head likewise.
    # Under fp8 a block's projection kernels travel as bytes, two per 16-bit carrier
    # (`precision.fp8_gather`): half the elements, and the forward gather carries each
    # device's amax per kernel (2 carriers each).
    fp8_gather = tiny.precision.policy == "fp8" and tiny.precision.fp8_gather
    for group in _block_groups(tiny_sizes):
        n = sum(tiny_sizes[p] for p in group)
        s = sum(real_sizes[p] for p in group) / n
        weights.setdefault(n, ("block", s))
        if fp8_gather and all("norm" not in p for p in group):
            half = (n + 1) // 2
            weights.setdefault(half, ("block (FP8 bytes)", s))
            weights.setdefault(half + 2 * len(group) * shape.get("fsdp", 1),
                               ("block (FP8 bytes)", s))
    tokens = _micro_tokens(tiny, shape)
    token_scale = _micro_tokens(config, shape) / tokens
    hidden_scale = config.model.hidden_dim / tiny.model.hidden_dim
    # The widths an activation of the tiny program can have (a merged buffer, a multiple
    # of 1024, can also be a multiple of the tokens: the width tells them apart). Under a
    # sequence split an activation's gradient is reduced over the whole gathered sequence
    # of several projections at once: on data=2,fsdp=4 a float32 all-reduce of 8 x
    # tokens x hidden, which multiples up to the axis size (4) took for a merged weight
    # buffer and scaled as weights (hidden squared): its bytes then followed the tiny
    # width. Multiples up to the device count classify it, and the scaled figures no
    # longer depend on the tiny width (tests/plan/test_measured.py).
    m, tp = tiny.model, shape.get("model", 1)
    devices = math.prod(shape.values())
    widths = {1, m.hidden_dim, m.hidden_dim // tp, m.vocab_size // tp,
              m.intermediate_dim // tp, m.num_query_heads * m.head_dim // tp,
              m.num_key_value_heads * m.head_dim // tp}
    widths |= {w * s for w in widths for s in range(2, devices + 1)}
    return {"weights": weights, "tokens": tokens, "token": token_scale, "widths": widths,
            "activation": token_scale * hidden_scale, "small": hidden_scale,
            "merged": sum(real_sizes.values()) / sum(tiny_sizes.values())}


def _block_groups(sizes: Dict[str, int]) -> List[List[str]]:
    """The weight paths whose gradients (or gathered shards) one block buffer holds: per
    block and for the final norm with the head, all of them and the kernels alone."""
    blocks: Dict[str, List[str]] = defaultdict(list)
    for path in sizes:
        m = re.search(r"block_\d+", path)
        key = m.group(0) if m else ("head" if ("final_norm" in path or "lm_head" in path)
                                    else None)
        if key:
            blocks[key].append(path)
    groups = []
    for paths in blocks.values():
        groups.append(paths)
        kernels = [p for p in paths if "norm" not in p]
        if kernels and len(kernels) < len(paths):
            groups.append(kernels)
    return groups


def classify(elements: int, sc: dict):
    """(class name, scale) of a collective of `elements` in the tiny program."""
    if elements in sc["weights"]:
        kind, s = sc["weights"][elements]
        return f"weight {kind}", s
    if elements <= PADDING:
        return "small", sc["small"]
    if elements % sc["tokens"] == 0 and elements // sc["tokens"] in sc["widths"]:
        return ("activation", sc["activation"] if elements > sc["tokens"] else sc["token"])
    return "merged gradients", sc["merged"]


def scaled_collectives(collectives: List[dict], sc: dict, shape,
                       groups: Optional[Dict[int, int]] = None) -> Dict[tuple, dict]:
    """{(kind, dtype, class): {count, elements, bytes, sent}} of one tiny run, scaled.

    `groups`: on a proxy mesh (`proxy_shape`), each group size of the run's mesh `shape`
    to the real mesh's (`group_sizes`): a collective is sent at its real group's ring
    factor."""
    fsdp = shape.get("fsdp", 1)
    out: Dict[tuple, dict] = defaultdict(lambda: {"count": 0, "elements": 0.0,
                                                  "bytes": 0.0, "sent": 0.0})
    for c in collectives:
        if c["elements"] is None or c["kind"] not in _RING:
            continue
        cls, s = classify(c["elements"], sc)
        kind = c["kind"]
        group = c["group_size"] or 1
        if (kind == "all-reduce" and cls.startswith("weight") and c["dtype"] == "float32"
                and fsdp > 1 and group == fsdp):
            kind = "reduce-scatter"  # under NCCL (see the module docstring)
            cls += " (all-reduce + slice on CPU)"
        family = cls.split(" ")[0] if cls.startswith("weight") else cls.split(" (")[0]
        t = out[(kind, c["dtype"], family + ("s" if family == "weight" else ""))]
        n = c["elements"] * s
        if groups:
            real = groups.get(group, group)
            if cls == "activation" and c.get("dtensor_op") == "all-gather":
                # an activation gathered over the group (a sequence split's keys and
                # values) holds every member's rows, each device's the same as on the
                # real mesh: it grows with the group
                n *= real / group
            group = real
        t["count"] += 1
        t["elements"] += n
        t["bytes"] += n * c["itemsize"]
        t["sent"] += _RING[kind] * (group - 1) / group * n * c["itemsize"]
    return dict(out)


def extrapolate(one: Dict[tuple, dict], two: Dict[tuple, dict], layers: int) -> List[dict]:
    """a + b x layers per group, from the 1- and 2-layer runs."""
    rows = []
    for key in sorted(set(one) | set(two)):
        a = one.get(key, {"count": 0, "elements": 0, "bytes": 0, "sent": 0})
        b = two.get(key, {"count": 0, "elements": 0, "bytes": 0, "sent": 0})
        row = {"kind": key[0], "dtype": key[1], "carries": key[2]}
        for f in ("count", "elements", "bytes", "sent"):
            row[f] = max(0.0, a[f] + (b[f] - a[f]) * (layers - 1))
        row["count"] = round(row["count"])
        rows.append(row)
    return sorted(rows, key=lambda r: -r["sent"])


def run_tiny(config, shape, layers=(1, 2), timeout: float = 3600, jit_compile: bool = True,
             tiny: bool = True, dump_to: Optional[str] = None) -> Dict[int, dict]:
    """{layers: {"collectives": those of the busiest device, "clusters": XLA clusters of
    its program}} of one step per layer count, run in a child process with as many
    logical CPU devices as the mesh has.

    Args:
      jit_compile: XLA-compile the step as `tfllm train` does on GPUs (DTensor splits
        each device's program into clusters; their count is what XLA is handed). Without
        it the collectives are the same and "clusters" is 0.
      tiny: run `tiny_config(config, n, shape)`; False runs `config` itself with n
        layers (its own widths: check that the cluster count does not depend on them).
      dump_to: a folder where XLA dumps the HLO of every cluster it compiles (the
        device programs DTensor hands it: `benchmarks/plan_device_clusters.py`).
    """
    from tfllm.config import to_dict
    devices = math.prod(shape.values())

    def at(n):
        if tiny:
            return tiny_config(config, n, shape)
        c = copy.deepcopy(config)
        c.model.num_layers, c.data.source = n, "synthetic"
        return c

    with files.temporary_folder("tfllm-measure-") as tmp:
        job = os.path.join(tmp, "job.json")
        files.write_atomically(tmp, job, json.dumps({
            "devices": devices, "jit_compile": jit_compile,
            "configs": {str(n): to_dict(at(n)) for n in layers}}))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
        # LLVM at -O0: the clusters and collectives are the same, CPU code generation of
        # each cluster much shorter (a tiny llama-1b step on fsdp=8 took over 15 minutes
        # at the default level on 2 busy cores)
        env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
        if dump_to:  # the real model runs: keep its kernels fast
            env["XLA_FLAGS"] = f"--xla_dump_to={dump_to} --xla_dump_hlo_as_text"
        r = subprocess.run([sys.executable, "-m", "tfllm.plan.measured", job],
                           capture_output=True, text=True, timeout=timeout, env=env)
        if r.returncode != 0:
            raise MeasureError(f"the tiny step on {devices} CPU devices failed:"
                               f"{_out_of_mappings(r.stderr)}\n{r.stderr[-3000:]}")
        with open(job + ".out") as f:
            return {int(k): v for k, v in json.load(f).items()}


def _out_of_mappings(stderr: str, limit_file: str = "/proc/sys/vm/max_map_count") -> str:
    """What to do when the child's XLA ran out of memory: " " + one sentence, or "".

    Each logical CPU device's compiled clusters are mapped into the process, so a wide
    mesh needs more memory mappings than Linux allows by default (65,530): llama-70b's
    tiny step on 128 devices held 157,000 mappings after 18 minutes, and XLA's code
    generation then failed with "Cannot allocate memory" with 10 GB of host memory free
    (benchmarks/results/h100_plan.md)."""
    if "Cannot allocate memory" not in stderr and "std::bad_alloc" not in stderr:
        return ""
    try:
        with open(limit_file) as f:
            limit = f"vm.max_map_count is {int(f.read().split()[0]):,}"
    except (OSError, ValueError, IndexError):
        limit = "vm.max_map_count could not be read"
    return (f" out of memory mappings or host memory ({limit}; each logical device maps "
            "its compiled clusters): raise it (sysctl -w vm.max_map_count=1048576, as "
            "root), plan on a host with more memory, or pass --collectives assumed")


def measure(config, shape, target_bandwidth: float) -> dict:
    """The measured collectives of one device per step for the real config.

    Args:
      config: the real config.
      shape: its mesh shape.
      target_bandwidth: link bytes per second the time is computed at.
    """
    proxy, groups, run_config = proxy_shape(shape), None, config
    if math.prod(shape.values()) > MAX_DEVICES and proxy is None:
        raise MeasureError(f"{config.mesh.axes}: more than {MAX_DEVICES} devices and no "
                           "smaller mesh of its data and fsdp axes tells its collectives' "
                           "groups apart; plan with --collectives assumed")
    if proxy:
        groups = group_sizes(proxy, shape)
        run_config = proxy_config(config, shape, proxy)
    run_shape = proxy or shape
    runs = run_tiny(run_config, run_shape)
    scaled = {}
    for n, run in runs.items():
        tiny = tiny_config(run_config, n, run_shape)
        scaled[n] = scaled_collectives(run["collectives"],
                                       scales(run_config, tiny, run_shape), run_shape, groups)
    rows = extrapolate(scaled[1], scaled[2], config.model.num_layers)
    # DTensor's clusters of one device: a + b x layers through the 1- and 2-layer
    # programs (each block adds the same clusters; checked against whole-depth programs
    # in benchmarks/h100_plan.py --clusters)
    one, two = runs[1]["clusters"], runs[2]["clusters"]
    clusters = one + (two - one) * (config.model.num_layers - 1)
    sent = sum(r["sent"] for r in rows)
    on_proxy = ("" if not proxy else f"; run on {run_config.mesh.axes} "
                f"({math.prod(proxy.values())} CPU devices, the global batch shrunk alike), "
                f"each collective sent at its group's ring factor on {config.mesh.axes}")
    detail = "; ".join(f"{r['kind']} {r['dtype']} {r['carries']} {r['sent'] / 1e9:.2f} GB"
                       for r in rows if r["sent"] >= 0.005e9)
    return {"bytes_per_device": sent, "detail": detail, "groups": rows,
            "count": sum(r["count"] for r in rows), "link_bandwidth": target_bandwidth,
            "seconds": sent / target_bandwidth, "basis": BASIS + on_proxy,
            "clusters": clusters, "clusters_basis": CLUSTERS_BASIS + on_proxy,
            "tiny_runs": {str(n): len(r["collectives"]) for n, r in runs.items()},
            "tiny_clusters": {str(n): r["clusters"] for n, r in runs.items()}}


def _child(job_path: str) -> None:
    """Runs one tiny step per config of the job on a CPU mesh; writes their collectives."""
    with open(job_path) as f:
        job = json.load(f)
    from tfllm.runtime.devices import setup_cpu_devices
    if setup_cpu_devices(job["devices"]) != job["devices"]:
        raise SystemExit(f"could not make {job['devices']} logical CPU devices")
    import keras
    from tfllm.compiler.reports import FirstCall
    from tfllm.config.loader import config_from_dict
    from tfllm.data import SyntheticTokens, feed
    from tfllm.parallel import make_parallel
    from tfllm.train.state import build_train_state
    out = {}
    for layers, data in job["configs"].items():
        cfg = config_from_dict(data)
        tokens = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=0)
        parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
        jit = job.get("jit_compile", False)
        step = build_train_state(cfg, parallel, jit).step
        first = FirstCall(parallel, jit)  # what the step communicates, read from its call
        step(feed.to_device(parallel, tokens.batch(0, cfg.train.global_batch_size, 1)),
             reader=first)
        costs = first.report.costs
        out[layers] = {"collectives": [c.as_dict() for c in costs.collectives],
                       "clusters": costs.clusters}
        keras.backend.clear_session()
    # the job's folder is the parent's temporary folder: the root of this write
    files.write_atomically(os.path.dirname(os.path.abspath(job_path)), job_path + ".out",
                           json.dumps(out))


if __name__ == "__main__":
    _child(sys.argv[1])
