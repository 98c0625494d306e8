"""The `tfllm` command: thin entry points over the library."""

from __future__ import annotations

import argparse
import json
import os
import sys

import tfllm  # noqa: F401  (sets KERAS_BACKEND before keras is imported)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of overrides (e.g. configs/tiny.yaml).")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="Override one setting (repeatable).")


def _load(args):
    from tfllm.config import load_config
    return load_config(args.config, args.overrides)


def _persist_compiles(config, workdir) -> None:
    """train.xla_cache, set as the process starts: TensorFlow parses TF_XLA_FLAGS at its
    first device query, and a library call (a Run inside pytest or a notebook) would only
    leak the setting into child processes, so only the command sets it."""
    from tfllm.parallel import runtime_env
    from tfllm.parallel.mesh import client_id
    runtime_env.xla_cache(runtime_env.xla_cache_dir(config.train.xla_cache, workdir,
                                                    client_id()))


def cmd_train(args) -> int:
    from tfllm.train.loop import train
    from tfllm.parallel.watchdog import PeerLost
    from tfllm.train.preemption import (NONFINITE_EXIT_CODE, PEER_LOST_EXIT_CODE,
                                        PREEMPTED_EXIT_CODE, NonFiniteError, Preempted)
    config = _load_for_workdir(args)
    _persist_compiles(config, args.workdir)
    try:
        last = train(config, args.workdir)
    except Preempted as e:
        print(f"tfllm train: {e}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except NonFiniteError as e:
        print(f"tfllm train: error: {e}", file=sys.stderr)
        return NONFINITE_EXIT_CODE
    except PeerLost as e:  # one line, no traceback: the cause is another process
        print(f"tfllm train: error: {e}", file=sys.stderr, flush=True)
        # At once: TensorFlow's multi-client shutdown would wait for the lost peer.
        from tfllm import quiet
        quiet.release()
        os._exit(PEER_LOST_EXIT_CODE)
    print(json.dumps({k: last[k] for k in ("step", "loss", "eval_loss", "tokens_per_s")
                      if k in last}))
    return 0


def _load_for_workdir(args):
    """--config and --set; with neither, an existing run's own config.yaml (resume)."""
    import os
    from tfllm.config import load_config
    saved = os.path.join(args.workdir, "config.yaml")
    if args.config is None and os.path.exists(saved):
        return load_config(saved, args.overrides)
    return load_config(args.config, args.overrides)


def _saved_config(args):
    """The config.yaml of --workdir, with --set overrides."""
    import os
    from tfllm.config import load_config
    saved = os.path.join(args.workdir, "config.yaml")
    if not os.path.exists(saved):
        raise FileNotFoundError(f"{saved} does not exist; --workdir must name a directory "
                                "written by tfllm train.")
    return load_config(saved, args.overrides)


def _restored_run(args):
    """The run in --workdir with its latest checkpoint's weights (any mesh via --set)."""
    import os
    from tfllm.checkpoint import Checkpointer, run_state_variables
    from tfllm.train.run import Run
    config = _saved_config(args)
    _persist_compiles(config, args.workdir)
    run = Run(config, workdir=args.workdir, train_iterator=False, inference=True)
    checkpointer = Checkpointer(os.path.join(args.workdir, "checkpoints"), run.parallel,
                                config.checkpoint)
    meta = checkpointer.restore_latest(run_state_variables(run.model), strict=False)
    if meta is None:
        raise FileNotFoundError(f"{args.workdir}/checkpoints holds no committed checkpoint; "
                                "train first (tfllm train --workdir ...).")
    return run, meta


def cmd_generate(args) -> int:
    from tfllm.train.run import sample_text
    run, meta = _restored_run(args)
    text = sample_text(run, args.prompt, args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(text)
    return 0


def cmd_eval(args) -> int:
    run, meta = _restored_run(args)
    if args.steps:
        run.config.train.eval_steps = args.steps
    result = run.evaluate()
    print(json.dumps({"step": int(meta["step"]), **result}))
    return 0


def cmd_export(args) -> int:
    if args.format == "keras-hub":
        from tfllm.pretrained.exporter import export_preset
        print(json.dumps(export_preset(_saved_config(args), args.workdir, args.out)))
        return 0
    from tfllm.train.export import export_model
    print(json.dumps(export_model(_saved_config(args), args.workdir, args.out)))
    return 0


def cmd_import(args) -> int:
    from tfllm.pretrained import import_preset
    print(json.dumps(import_preset(args.preset, args.workdir, args.overrides, args.tokenizer)))
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
    _persist_compiles(config, None)  # no workdir: only an explicit train.xla_cache
    print(json.dumps(benchmark(config, args.steps, args.warmup, args.repeats)))
    return 0


def cmd_doctor(args) -> int:
    """Prints every GPU start-up check of this host; exit 2 when one fails."""
    from tfllm.parallel import gpu_checks
    config = _load(args)
    findings = gpu_checks.check(gpu_checks.gather(), config.precision.policy,
                                config.mesh.device_type)
    for f in findings:
        print(f"{f.level}: {f.message}")
    return 2 if gpu_checks.first_error(findings) else 0


def cmd_plan(args) -> int:
    from tfllm.plan.measured import MeasureError
    from tfllm.plan.planner import PlanError, format_plan, plan
    config = _load(args)
    try:
        result = plan(config, args.target, args.layers, args.devices, args.collectives)
    except (PlanError, MeasureError) as e:
        print(f"tfllm plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_plan(result))
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
    p = sub.add_parser("launch", help="Start and supervise the clients of a multi-client "
                       "job (tfllm launch --help).", add_help=False)
    p.add_argument("launch_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("train", help="Train a model; writes config.yaml and metrics.jsonl.")
    _common(p)
    p.add_argument("--workdir", default="runs/default", help="Run directory.")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("generate", help="Generate text with a trained run's model.")
    p.add_argument("--workdir", required=True, help="A run directory of tfllm train.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting, e.g. mesh.axes.")
    p.add_argument("--prompt", required=True, help="The text to continue.")
    p.add_argument("--max-new-tokens", type=int, default=64, help="Tokens to generate.")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="Sampling temperature; 0 means greedy.")
    p.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely "
                   "tokens (0: all).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling: the smallest "
                   "set of tokens whose probability reaches p (1: all).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("eval", help="Validation loss and perplexity of a trained run.")
    p.add_argument("--workdir", required=True, help="A run directory of tfllm train.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting, e.g. mesh.axes.")
    p.add_argument("--steps", type=int, default=0,
                   help="Validation batches (0: train.eval_steps).")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("export", help="Write a single-device model (SavedModel + Keras "
                       "weights) from a run's latest checkpoint.")
    p.add_argument("--workdir", required=True, help="A run directory of tfllm train.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting.")
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--format", default="saved-model", choices=("saved-model", "keras-hub"),
                   help="saved-model (SavedModel + Keras weights) or keras-hub (a preset "
                        "that keras_hub.models.CausalLM.from_preset loads).")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("import", help="Write a run at step 0 from a local keras-hub preset "
                       "or Hugging Face checkpoint folder, for generate/eval/train/export.")
    p.add_argument("--preset", required=True, help="The preset or checkpoint directory.")
    p.add_argument("--workdir", required=True, help="The new run directory.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting, e.g. mesh.axes.")
    p.add_argument("--tokenizer", default=None, help="Use this tokenizer instead of the "
                   "preset's: a keras-hub tokenizer preset or a SentencePiece .model file.")
    p.set_defaults(fn=cmd_import)
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
    p = sub.add_parser("doctor", help="Check this host's GPUs, driver, CUDA libraries and "
                       "TensorFlow build for a run of --config (exit 2 on an error).")
    _common(p)
    p.set_defaults(fn=cmd_doctor)
    p = sub.add_parser("plan", help="Compile the train step for a GPU target (no GPU "
                       "needed); print memory, kernels and a step-time estimate.")
    _common(p)
    p.add_argument("--target", default="h100", choices=("h100", "h200", "b200", "a100"),
                   help="The GPU to compile for (default h100).")
    p.add_argument("--devices", type=int, default=None,
                   help="Device count, for a mesh axis of -1 (default 1).")
    p.add_argument("--layers", default="auto", choices=("auto", "full", "extrapolate"),
                   help="Compile every layer, or 1 and 2 layers and extrapolate "
                        "(auto: when the model would not fit this host's memory).")
    p.add_argument("--collectives", default="measured", choices=("measured", "assumed"),
                   help="On a sharded mesh: measure them on the executed CPU program of the "
                        "mesh at a tiny scale (about a minute), or only assume the layout's "
                        "formula (default measured; both are printed).")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("export-step", help="Write the one-device XLA train step (HLO) and "
                       "its parameter description, for benchmarks/gpu/run_step.py.")
    _common(p)
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--check", action="store_true",
                   help="Also save one step's inputs and TensorFlow's outputs (check.npz).")
    p.set_defaults(fn=cmd_export_step)
    return parser


def _input_errors() -> tuple:
    """Errors caused by bad input (config, data, checkpoint, workdir): exit 2, no trace."""
    from tfllm.checkpoint import CheckpointError
    from tfllm.config import ConfigError
    from tfllm.data import DataError
    from tfllm.parallel.coordination import ClientMismatchError
    from tfllm.parallel.mesh import MeshError
    from tfllm.parallel.rules import ShardingError
    from tfllm.pretrained.families import PretrainedError
    return (ConfigError, MeshError, ShardingError, DataError, CheckpointError,
            ClientMismatchError, FileNotFoundError, PretrainedError)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # its own options (a launcher parses no tfllm flags)
        from tfllm.launch.main import main as launch
        return launch(argv[1:], "tfllm launch")
    args = build_parser().parse_args(argv)
    errors = _input_errors()
    try:
        return args.fn(args)
    except errors as e:
        print(f"tfllm {args.command}: error: {e}", file=sys.stderr)
        return 2


def command() -> int:
    """The `tfllm` console command: `main` with TensorFlow's C++ start-up records filtered
    from stderr (tfllm.quiet). Only the command filters: a process that calls `main` itself
    (a test, a notebook) keeps its own file descriptors."""
    if sys.argv[1:2] != ["launch"]:  # the launcher imports no TensorFlow
        from tfllm.quiet import install
        install(tfllm.USER_TF_LOG_LEVEL)  # before TensorFlow is imported and starts logging
    return main()


if __name__ == "__main__":
    sys.exit(command())
