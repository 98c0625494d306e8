"""What is alive at the compiled peak of the step `tfllm plan` compiles, buffer by buffer.

    python benchmarks/plan_peak_buffers.py --config configs/llama-1b.yaml --devices 8 \
        [--set train.grad_accum_steps=2] [--layers 1 2] [--show-mib 64]

For each layer count, the one-device step at one mesh device's shapes (what the planner
compiles: `tfllm.footprint.layout.mesh_plan(...).local`) is exported
(`tfllm.plan.planner.export_in_child`) and compiled deviceless for the H100
(`tfllm.plan.gpu_compile`, the planner's flags) with XLA's dumps on. XLA's
`*-live-range.txt` lists every buffer alive at the program's peak; `*-buffer-assignment.txt`
gives its shape and the optimized HLO the TensorFlow op that made it. Each buffer is put in
a category by its op name (TensorFlow's names in the step: `gradient_tape/...` for the
backward pass, `.../Einsum/Cast` for a weight's 16-bit copy); the categories at 1 and 2
layers are extrapolated to the model's depth as the planner extrapolates (a + b x layers).
benchmarks/results/h100_plan.md ("llama-1b's gap to the arithmetic, buffer by buffer") has
the results for llama-1b.

The categories read TensorFlow's op names, so they describe the tfllm step as it is
written today; a buffer no rule names is counted as an activation (the listing with
--show-mib shows each buffer's op and shape to check).
"""

from __future__ import annotations

import argparse
import collections
import copy
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2 ** 30


def categorize(size: int, name: str, shape: str, op: str) -> str:
    """The category of one buffer alive at the peak (see the module docstring)."""
    if name.startswith("XLA_Args"):
        return "arguments (state and tokens)"
    if "gradient_tape" in op and re.search(r"Cast_1/Cast$", op):
        return "logits"  # the logits' bf16 gradient (their float32 cast's gradient)
    if re.search(r"(^|/)llama_\d+/einsum/Einsum$|(^|/)gpt_\d+/einsum/Einsum$", op):
        return "logits"  # the head's GEMM output
    if "gradient_tape" in op and re.search(r"Einsum_1$", op) and not shape.startswith("f32"):
        return "16-bit weight gradients (earlier micro-batches)"
    if re.search(r"einsum/Einsum/Cast$|GatherV2/Cast$", op):
        return "16-bit weight copies"
    if shape.startswith("f32") and "AddN" in op:
        return "float32 weight gradients"
    return "activations"


def peak_buffers(dump: str):
    """[(bytes, buffer, shape, op name)] alive at the peak of the dumped program."""
    live_range = open(glob.glob(f"{dump}/*after_optimizations-live-range.txt")[0]).read()
    peak = live_range.split("(peak):")[1].split("Stack trace")[0]
    live = re.findall(r"^\s+(\S+): (\d+) bytes", peak, re.M)
    assignment = open(glob.glob(f"{dump}/*after_optimizations-buffer-assignment.txt")[0]).read()
    shapes = dict(re.findall(r"value: <\d+ (\S+) @0> \(size=\d+,offset=\d+\): (.*)",
                             assignment))
    hlo = open(glob.glob(f"{dump}/*after_optimizations.txt")[0]).read()
    ops = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", hlo, re.M):
        ops.setdefault(m.group(1), m.group(2))
    return [(int(size), name, shapes.get(name, shapes.get(name.replace("{}", ""), "?")),
             ops.get(name.split("{")[0], "?")) for name, size in live]


def compile_with_dumps(config, work: str) -> dict:
    """Exports `config`'s step to `work` and compiles it for the H100 with XLA's dumps in
    `work/dump`; returns the compiled memory figures."""
    from tfllm.compiler.targets import get_target
    from tfllm.plan import planner
    planner.export_in_child("step", config, work)
    target_config = os.path.join(work, "h100.txtpb")
    with open(target_config, "w") as f:
        f.write(get_target("h100").target_config())
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={work}/dump --xla_dump_hlo_as_text")
    out = os.path.join(work, "compiled.json")
    r = subprocess.run([sys.executable, "-m", "tfllm.plan.gpu_compile",
                        os.path.join(work, "step.hlo.pb"), "--target-config", target_config,
                        "--out", out], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    with open(out) as f:
        return json.load(f)["memory"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--layers", type=int, nargs=2, default=(1, 2))
    parser.add_argument("--show-mib", type=float, default=None,
                        help="List every buffer of at least this many MiB at each peak.")
    parser.add_argument("--json", help="Write the figures here too.")
    args = parser.parse_args(argv)
    from tfllm.config import load_config
    from tfllm.footprint import layout
    config = load_config(args.config, args.sets)
    local = layout.mesh_plan(config, args.devices).local
    depth = local.model.num_layers
    figures = {}
    with tempfile.TemporaryDirectory(prefix="tfllm-peak-") as tmp:
        for n in args.layers:
            c = copy.deepcopy(local)
            c.model.num_layers = n
            work = os.path.join(tmp, f"layers{n}")
            memory = compile_with_dumps(c, work)
            rows = peak_buffers(os.path.join(work, "dump"))
            totals = collections.Counter()
            for r in rows:
                totals[categorize(*r)] += r[0]
            figures[n] = {"temp": memory["temp"], **totals}
            if args.show_mib is not None:
                print(f"-- {n} layer(s): buffers alive at the peak of at least "
                      f"{args.show_mib:g} MiB")
                for size, name, shape, op in sorted(rows, reverse=True):
                    if size >= args.show_mib * 2 ** 20:
                        print(f"{size / 2**20:9.1f} MiB  {categorize(size, name, shape, op):48s}"
                              f" {shape[:40]:40s} {op}")
    a, b = args.layers
    keys = sorted(set(figures[a]) | set(figures[b]), key=lambda k: (k == "temp", k))
    line = lambda k: figures[a].get(k, 0) + (figures[b].get(k, 0) - figures[a].get(k, 0)) * (  # noqa: E731
        depth - a) / (b - a)
    print(f"{'GiB at the compiled peak':48s} {a:>8d} {b:>8d} {depth:>8d} layers")
    for k in keys:
        label = "temporaries (XLA's temp allocation)" if k == "temp" else k
        print(f"{label:48s} {figures[a].get(k, 0) / GIB:8.2f} {figures[b].get(k, 0) / GIB:8.2f}"
              f" {line(k) / GIB:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "sets": args.sets, "devices": args.devices,
                       "figures": figures,
                       "extrapolated": {k: line(k) for k in keys}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
