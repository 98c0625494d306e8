"""The `tfllm` command: thin entry points over the library."""

from __future__ import annotations

import argparse
import json
import sys

import tfllm  # noqa: F401  (sets KERAS_BACKEND before keras is imported)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of overrides (e.g. configs/tiny.yaml).")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="Override one setting (repeatable).")


def _load(args):
    from tfllm.config import load_config
    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    from tfllm.train.loop import train
    config = _load(args)
    last = train(config, args.workdir)
    print(json.dumps({k: last[k] for k in ("step", "loss", "tokens_per_s") if k in last}))
    return 0


def cmd_layouts(args) -> int:
    from tfllm.models import build_model
    from tfllm.parallel.layouts import format_table, layout_rows, mesh_shape_from_config
    from tfllm.parallel.rules import rules_from_config
    config = _load(args)
    shape = mesh_shape_from_config(config, args.num_devices)
    model = build_model(config, allocate=False)  # shapes only: no memory is allocated
    rows = layout_rows(model, rules_from_config(config.mesh.rules), shape,
                       config.optimizer.shard_optimizer_state)
    print(format_table(rows, shape))
    return 0


def cmd_bench(args) -> int:
    from tfllm.train.bench import benchmark
    config = _load(args)
    print(json.dumps(benchmark(config, args.steps, args.warmup, args.repeats)))
    return 0


def cmd_export_step(args) -> int:
    from tfllm.train.export_step import export_step
    config = _load(args)
    desc = export_step(config, args.out, check=args.check)
    print(json.dumps({"out": args.out, "params": len(desc["params"]),
                      "outputs": len(desc["outputs"]), "num_params": desc["num_params"],
                      "flops_per_token": desc["flops_per_token"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="Train a model; writes config.yaml and metrics.jsonl.")
    _common(p)
    p.add_argument("--workdir", default="runs/default", help="Run directory.")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("layouts", help="Print each variable's layout and bytes per device "
                       "without allocating the model.")
    _common(p)
    p.add_argument("--num-devices", type=int, default=None,
                   help="Device count, needed when a mesh axis is -1.")
    p.set_defaults(fn=cmd_layouts)
    p = sub.add_parser("bench", help="Time the train step; print one JSON line.")
    _common(p)
    p.add_argument("--steps", type=int, default=20, help="Timed steps per repeat.")
    p.add_argument("--warmup", type=int, default=3, help="Untimed steps first.")
    p.add_argument("--repeats", type=int, default=1, help="Repeat the timed steps.")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("export-step", help="Write the one-device XLA train step (HLO) and "
                       "its parameter description, for benchmarks/gpu/run_step.py.")
    _common(p)
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--check", action="store_true",
                   help="Also save one step's inputs and TensorFlow's outputs (check.npz).")
    p.set_defaults(fn=cmd_export_step)
    return parser


def main(argv=None) -> int:
    from tfllm.config import ConfigError
    from tfllm.parallel.mesh import MeshError
    from tfllm.parallel.rules import ShardingError
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, MeshError, ShardingError) as e:
        print(f"tfllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
