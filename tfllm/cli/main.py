"""The `tfllm` command: thin entry points over the library."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import signal
import sys
import traceback
from typing import Optional

import tfllm  # noqa: F401  (sets KERAS_BACKEND before keras is imported)
from tfllm import files
from tfllm.contracts import (BAD_INPUT_EXIT_CODE, HARD_STOP_EXIT_CODE, IO_ERROR_EXIT_CODE,
                              NONFINITE_EXIT_CODE, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE,
                              InputError, io_failure)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the flag (exit 2), without the usage."""

    def error(self, message):
        self.exit(BAD_INPUT_EXIT_CODE, f"{self.prog}: error: {message} (see "
                                       f"{self.prog} --help)\n")


def _whole(minimum: int, maximum: Optional[int] = None):
    """An argparse type: an integer in [minimum, maximum]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = (f"at least {minimum}" if maximum is None
                     else f"between {minimum} and {maximum}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def _real(minimum: float, maximum: float = math.inf, open_low: bool = False):
    """An argparse type: a finite number >= minimum (> with open_low) and <= maximum."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_ok = value > minimum if open_low else value >= minimum
        if not (math.isfinite(value) and low_ok and value <= maximum):
            low = f"{'>' if open_low else '>='} {minimum:g}"
            bound = low if maximum == math.inf else f"{low} and <= {maximum:g}"
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text}")
        return value
    return parse


def _text(text: str) -> str:
    """An argparse type: a non-empty string."""
    if not text:
        raise argparse.ArgumentTypeError("is empty; give the text to continue")
    try:  # bytes that are not UTF-8 reach Python as lone surrogates (PEP 383)
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"is not UTF-8 text (character {e.start}); give "
                                         "UTF-8 text, as the terminal's locale encodes "
                                         "it") from None
    return text


#: errno values of a path the system refuses to resolve (checked before any work)
_REFUSED_PATH_ERRNOS = frozenset((errno.ELOOP, errno.ENAMETOOLONG, errno.ENOTDIR,
                                  errno.EACCES))


def user_path(text: str) -> str:
    """An argparse type for every path given on the command line (--workdir, --out,
    --config, --preset, ...): `~` expanded (`--workdir=~/r` reaches tfllm unexpanded, and
    a run split over `~/r` and a folder named `~`), UTF-8, and resolvable by the system;
    each refusal one line naming the flag (exit 2), before any work."""
    if not text:
        raise argparse.ArgumentTypeError("is empty; give a path")
    path = os.path.expanduser(text)
    if path.startswith("~"):
        raise argparse.ArgumentTypeError(
            f"{text}: {path.split(os.sep)[0]} names no home folder on this host; give the "
            "path in full")
    try:  # bytes that are not UTF-8 reach Python as lone surrogates (PEP 383)
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(
            f"{path.encode('utf-8', 'backslashreplace').decode()}: not a UTF-8 name "
            f"(byte {e.start}); tfllm writes paths into UTF-8 files (config.yaml, "
            "metrics): rename it or choose another path") from None
    try:
        os.stat(path)
    except FileNotFoundError:
        pass  # made when the command writes it
    except OSError as e:
        if e.errno not in _REFUSED_PATH_ERRNOS:
            raise
        shown = path if len(path) <= 80 else f"{path[:60]}... ({len(path)} characters)"
        raise argparse.ArgumentTypeError(
            f"{shown}: {e.strerror}; give a path the system accepts (each name at most "
            "255 bytes, no symbolic link loop, folders all the way down)") from None
    return path


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=user_path,
                        help="YAML file of overrides (e.g. configs/tiny.yaml).")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="Override one setting (repeatable).")


def _load(args):
    from tfllm.config import load_config
    return load_config(args.config, args.overrides)


def _persist_compiles(args, config, workdir) -> None:
    """train.xla_cache and the precision policy's XLA flags (FP8 GEMMs need Triton GEMMs
    off: tfllm.runtime.environment.POLICY_XLA_FLAGS), set as the process starts:
    TensorFlow parses TF_XLA_FLAGS at its first device query, XLA its XLA_FLAGS at the
    first compile, and a library call (a Run inside pytest or a notebook) would only
    leak the setting into child processes, so only the command sets it. The folders it
    creates are kept in `args.created`: a command that fails removes them while they are
    still empty (`main`), so that a refused run leaves its workdir as it was."""
    from tfllm.runtime import environment
    from tfllm.contracts import client_id
    directory = environment.xla_cache_dir(config.train.xla_cache, workdir, client_id())
    if directory:
        args.created = files.missing_folders(os.path.join(directory, "autotune"))
    environment.precision_flags(config.precision.policy)  # FP8 GEMMs on a GPU
    try:
        environment.xla_cache(directory)
    except OSError as e:
        if args.command not in ("generate", "eval") or io_failure(e) is None:
            raise
        # Reading a run needs no cache: a read-only or full workdir still serves it.
        print(f"tfllm {args.command}: warning: no XLA compile cache ({_one_line(e)}); "
              "compiling without it.", file=sys.stderr)


def cmd_train(args) -> int:
    from tfllm.train.preemption import SignalWatcher
    # From the command's start, before TensorFlow's import and the run's set-up: a first
    # SIGTERM/SIGINT is kept for the loop (which saves and exits 75 at its first step
    # boundary), a second exits 130 at once, as at any later time.
    with SignalWatcher():
        return _train(args)


def _train(args) -> int:
    from tfllm.train.loop import train
    from tfllm.train.preflight import check_memory
    from tfllm.train.saved_run import config_for
    from tfllm.runtime.watchdog import PeerLost
    from tfllm.train.preemption import NonFiniteError, Preempted
    from tfllm.checkpoint.workdir import check_workdir
    from tfllm.config.loader import to_dict
    config = config_for(args.workdir, args.config, args.overrides)
    check_memory(config)  # before the workdir is checked or anything is made
    # Once, here: a refused workdir gets no XLA cache folder either.
    checked = check_workdir(args.workdir, to_dict(config))
    _persist_compiles(args, config, args.workdir)
    try:
        last = train(config, args.workdir, checked=checked)
    except Preempted as e:
        if e.__cause__ is None:
            print(f"tfllm train: {e}", file=sys.stderr)
        else:  # still 75: the signal is why the run stopped; say that the save failed
            print(f"tfllm train: stopped by a signal after step {e.step}, but its "
                  f"checkpoint could not be saved: {_one_line(e.__cause__)}. "
                  f"{_latest_checkpoint(args.workdir)}; run the same command to resume "
                  "from it.", file=sys.stderr)
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


def _latest_checkpoint(workdir: str) -> str:
    """A sentence naming the run's latest committed checkpoint, for failure messages."""
    from tfllm.checkpoint.workdir import Workdir
    run_dir = Workdir(workdir)
    directory, steps = run_dir.checkpoints, run_dir.committed()
    if not steps:
        return f"No checkpoint of this run is committed in {directory}"
    return (f"The latest committed checkpoint, step {steps[-1][0]} in {directory}, is "
            "intact")


def _restored_run(args, config=None):
    """The run in --workdir with its latest checkpoint's weights (any mesh via --set)."""
    from tfllm.train.saved_run import require_checkpoint, restored_run, saved_config
    config = saved_config(args.workdir, args.overrides) if config is None else config
    from tfllm.train.preflight import check_host_memory
    require_checkpoint(args.workdir)  # before anything is built or written
    check_host_memory(config)
    _persist_compiles(args, config, args.workdir)
    return restored_run(args.workdir, config)


def cmd_generate(args) -> int:
    from tfllm.train.saved_run import saved_config
    config = saved_config(args.workdir, args.overrides)  # before TensorFlow
    if config.data.source == "synthetic":  # before the weights are read
        raise InputError(f"--workdir {args.workdir}: this run trained on data.source="
                         "synthetic and has no tokenizer, so there is no text to generate; "
                         "use a run trained on text.")
    run, meta = _restored_run(args, config)
    if args.chat:  # the reply through the run's chat template (tfllm.generate.chat)
        from tfllm.generate.chat import chat_reply
        # the template the run trained with (its own copy), unless named here with --set
        named = any(o.split("=")[0].strip() == "data.chat_template" for o in args.overrides)
        print(chat_reply(run, args.prompt, args.max_new_tokens, own_template=not named,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed))
        return 0
    from tfllm.train.run import PromptError, sample_text
    try:
        text = sample_text(run, args.prompt, args.max_new_tokens, prompt_name="--prompt",
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed)
    except PromptError as e:
        raise InputError(str(e)) from None
    print(text)
    return 0


def cmd_eval(args) -> int:
    if args.tasks is not None:
        return _eval_tasks(args)
    alone = [flag for flag, given in (
        ("--num-fewshot", args.num_fewshot is not None), ("--limit", args.limit is not None),
        ("--include-path", args.include_path), ("--apply-chat-template",
                                                 args.apply_chat_template),
        ("--log-samples", args.log_samples), ("--add-bos-token", args.add_bos_token)) if given]
    if alone:
        raise InputError(f"{alone[0]} goes with --tasks (lm-eval tasks); without it "
                         "tfllm eval reports the validation loss.")
    run, meta = _restored_run(args)
    result = run.evaluate(args.steps or None)
    print(json.dumps({"step": int(meta["step"]), **result}))
    return 0


def _eval_tasks(args) -> int:
    """`tfllm eval --tasks`: lm-eval's tasks on the run (`tfllm.evals.benchmark`)."""
    from tfllm.train.saved_run import saved_config
    config = saved_config(args.workdir, args.overrides)  # a folder that is no run: first
    try:  # the optional extra, before the weights are read
        from tfllm.evals.benchmark import evaluate_tasks, load_tasks, task_manager
    except ImportError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        raise InputError("--tasks needs the lm-evaluation-harness: pip install "
                         "'tfllm[eval]'.") from None
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    if not names:
        raise InputError("--tasks: give task names, e.g. --tasks tfllm_tiny_mc,hellaswag.")
    if config.data.source == "synthetic":
        raise InputError(f"--workdir {args.workdir}: this run trained on data.source="
                         "synthetic and has no tokenizer; lm-eval tasks are text.")
    # a missing task or unreadable task data: one line before the weights are read
    loaded = load_tasks(task_manager(names, args.include_path), names)
    run, meta = _restored_run(args, config)
    limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
    result = evaluate_tasks(run, names, args.num_fewshot, limit, args.batch_size,
                            args.include_path, args.apply_chat_template, args.log_samples,
                            args.add_bos_token, loaded=loaded, step=int(meta["step"]))
    print(json.dumps({"step": int(meta["step"]), "results": result["results"],
                      "files": result["files"]}))
    return 0


def cmd_export(args) -> int:
    from tfllm.train.saved_run import saved_config
    # a folder that is no run is refused before TensorFlow
    config = saved_config(args.workdir, args.overrides)
    if args.merge_lora and args.format != "hf":
        raise InputError("--merge-lora goes with --format hf.")
    from tfllm.pretrained.formats import export_run
    print(json.dumps(export_run(args.format, config, args.workdir, args.out, args.dtype,
                                args.max_shard_size, args.merge_lora,
                                vllm_check=not args.skip_vllm_checks)))
    return 0


def cmd_import(args) -> int:
    from tfllm.pretrained import import_preset
    print(json.dumps(import_preset(args.preset, args.workdir, args.overrides, args.tokenizer,
                                   args.adapter, args.config)))
    return 0


def cmd_layouts(args) -> int:
    from tfllm.models import build_model
    from tfllm.parallel.layouts import format_table, layout_rows, mesh_shape_from_config
    from tfllm.parallel.rules import rules_from_config
    config = _load(args)
    shape = mesh_shape_from_config(config.mesh, args.num_devices)
    # shapes only: no memory is allocated
    model = build_model(config.model, config.precision, config.lora, allocate=False)
    rules = rules_from_config(config.mesh.rules)
    rows = layout_rows(model, rules, shape, config.optimizer.shard_optimizer_state)
    print(format_table(rows, shape))
    if args.plot:
        from tfllm.parallel.plot import plot_layouts
        batch = (config.train.global_batch_size, config.data.sequence_length)
        plot_layouts(rows, shape, rules, batch_shape=batch, path=args.plot)
        print(f"picture: {args.plot} (the mesh, the first block's query and MLP kernels, "
              f"the token embedding and a {batch[0]} x {batch[1]} token batch, coloured by "
              "device)")
    return 0


def cmd_bench(args) -> int:
    from tfllm.train.bench import benchmark
    config = _load(args)
    _persist_compiles(args, config, None)  # no workdir: only an explicit train.xla_cache
    print(json.dumps(benchmark(config, args.steps, args.warmup, args.repeats)))
    return 0


def cmd_doctor(args) -> int:
    """Prints every GPU start-up check of this host; exit 2 when one fails."""
    from tfllm.doctor.diagnose import JobOptionError, JobOptions, diagnose
    from tfllm.runtime.gpu_checks import first_error
    config = _load(args)
    job = None
    if args.report_dir is not None:
        job = JobOptions(args.report_dir, args.rank, args.world_size, args.ports, args.wait_s)
    try:
        findings = diagnose(config, args.config is not None, job)
    except JobOptionError as e:
        raise InputError(f"{e} (--rank, --world-size, --ports P1,P2,... of whole numbers)")
    for f in findings:
        print(f"{f.level}: {f.message}")
    return BAD_INPUT_EXIT_CODE if first_error(findings) else 0


def cmd_plan(args) -> int:
    from tfllm.plan.measured import MeasureError
    from tfllm.plan.planner import PlanError, format_plan, plan
    config = _load(args)
    try:
        result = plan(config, args.target, args.layers, args.devices, args.collectives)
    except (PlanError, MeasureError) as e:
        print(f"tfllm plan: error: {e}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    print(json.dumps(result.to_json()) if args.json else format_plan(result))
    return 0


def cmd_export_step(args) -> int:
    from tfllm.plan.export_step import export_step
    config = _load(args)
    desc = export_step(config, args.out, check=args.check)
    print(json.dumps({"out": args.out, "params": len(desc["params"]),
                      "outputs": len(desc["outputs"]), "num_params": desc["num_params"],
                      "flops_per_token": desc["flops_per_token"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tfllm", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="Start and supervise the clients of a multi-client "
                       "job (tfllm launch --help).", add_help=False)
    p.add_argument("launch_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("train", help="Train a model; writes config.yaml and metrics.jsonl.")
    _common(p)
    p.add_argument("--workdir", type=user_path, default="runs/default",
                   help="Run directory.")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("generate", help="Generate text with a trained run's model.")
    p.add_argument("--workdir", type=user_path, required=True,
                   help="A run directory of tfllm train.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting, e.g. mesh.axes.")
    p.add_argument("--prompt", required=True, type=_text, help="The text to continue.")
    p.add_argument("--max-new-tokens", type=_whole(1), default=64,
                   help="Tokens to generate (at least 1).")
    p.add_argument("--temperature", type=_real(0.0), default=0.0,
                   help="Sampling temperature >= 0; 0 means greedy.")
    p.add_argument("--top-k", type=_whole(0), default=0, help="Sample among the k most "
                   "likely tokens (0: all).")
    p.add_argument("--top-p", type=_real(0.0, 1.0, open_low=True), default=1.0,
                   help="Nucleus sampling: the smallest set of tokens whose probability "
                        "reaches p, 0 < p <= 1 (1: all).")
    p.add_argument("--seed", type=_whole(-2 ** 31, 2 ** 31 - 1), default=0,
                   help="Seed of the sampling (a 32-bit integer).")
    p.add_argument("--chat", action="store_true",
                   help="--prompt is a user message (or a JSON list of messages): render it "
                        "with the run's chat template and its generation prompt, print the "
                        "assistant's reply, stop at the template's end of turn.")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("eval", help="Validation loss and perplexity of a trained run.")
    p.add_argument("--workdir", type=user_path, required=True,
                   help="A run directory of tfllm train.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting, e.g. mesh.axes.")
    p.add_argument("--steps", type=_whole(0), default=0,
                   help="Validation batches (0: train.eval_steps).")
    p.add_argument("--tasks", default=None, metavar="T1,T2",
                   help="Score lm-evaluation-harness tasks instead (names, globs or task "
                        "YAML files; tfllm_tiny_mc, tfllm_tiny_gen, tfllm_tiny_ppl ship with "
                        "tfllm); writes lm-eval's results JSON to WORKDIR/eval. Needs "
                        "pip install 'tfllm[eval]'.")
    p.add_argument("--num-fewshot", type=_whole(0), default=None,
                   help="--tasks: few-shot examples per context (default: each task's).")
    p.add_argument("--limit", type=_real(0.0, open_low=True), default=None,
                   help="--tasks: documents per task (below 1: that fraction of them).")
    p.add_argument("--batch-size", type=_whole(1), default=8,
                   help="--tasks: requests per forward pass or generation batch.")
    p.add_argument("--include-path", type=user_path, action="append", default=[],
                   metavar="DIR", help="--tasks: a folder of task YAML files (repeatable).")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="--tasks: render contexts with the run's chat template, few-shot "
                        "examples as turns.")
    p.add_argument("--log-samples", action="store_true",
                   help="--tasks: also write each task's samples (JSON lines).")
    p.add_argument("--add-bos-token", action="store_true",
                   help="--tasks: put the tokenizer's BOS before every request (for models "
                        "whose Hugging Face tokenizer adds one).")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("export", help="Write a single-device model (SavedModel + Keras "
                       "weights) from a run's latest checkpoint.")
    p.add_argument("--workdir", type=user_path, required=True,
                   help="A run directory of tfllm train.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting.")
    p.add_argument("--out", type=user_path, required=True, help="Output directory.")
    p.add_argument("--format", default="saved-model",
                   choices=("saved-model", "keras-hub", "hf", "peft"),  # formats.FORMATS
                   help="saved-model (SavedModel + Keras weights), keras-hub (a preset "
                        "that keras_hub.models.CausalLM.from_preset loads), hf (a "
                        "folder that transformers' from_pretrained loads and vLLM serves) "
                        "or peft (a run's LoRA adapter: adapter_config.json + "
                        "adapter_model.safetensors, for peft's PeftModel and vLLM "
                        "--enable-lora).")
    p.add_argument("--merge-lora", action="store_true",
                   help="--format hf of a LoRA run: merge each adapter into its weight "
                        "(W + s A B, in float32, then --dtype).")
    p.add_argument("--skip-vllm-checks", action="store_true",
                   help="--format peft: write an adapter vLLM would refuse (a rank outside "
                        "its --max-lora-rank values, GPT-2); peft still loads it.")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="--format hf: the stored weights' dtype (float32: exact; bfloat16: "
                        "rounded to nearest even).")
    p.add_argument("--max-shard-size", default="5GB",
                   help="--format hf: the largest safetensors file (e.g. 5GB, 500MB); "
                        "larger models are split, with model.safetensors.index.json.")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("import", help="Write a run at step 0 from a local keras-hub preset "
                       "or Hugging Face checkpoint folder, for generate/eval/train/export.")
    p.add_argument("--preset", type=user_path, required=True,
                   help="The preset or checkpoint directory.")
    p.add_argument("--workdir", type=user_path, required=True, help="The new run directory.")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="Override a setting, e.g. mesh.axes.")
    p.add_argument("--tokenizer", type=user_path, default=None,
                   help="Use this tokenizer instead of the preset's: a keras-hub tokenizer "
                        "preset or a SentencePiece .model file.")
    p.add_argument("--config", type=user_path, default=None,
                   help="A YAML file of fine-tuning settings "
                        "(data, train, lora, ...; e.g. configs/sft-lora.yaml) applied over the "
                        "preset's model and the fine-tuning defaults, before --set.")
    p.add_argument("--adapter", type=user_path, default=None,
                   help="A PEFT LoRA adapter folder trained on "
                        "this base (adapter_config.json + adapter_model.safetensors): the run "
                        "gets its lora settings and weights, to evaluate or train on.")
    p.set_defaults(fn=cmd_import)
    p = sub.add_parser("layouts", help="Print each variable's layout and bytes per device "
                       "without allocating the model.")
    _common(p)
    p.add_argument("--num-devices", type=_whole(1), default=None,
                   help="Device count, needed when a mesh axis is -1.")
    p.add_argument("--plot", type=user_path, default=None, metavar="FILE.png",
                   help="Also draw the mesh, the first block's query and MLP kernels, the "
                        "token embedding and a token batch, coloured by device (PNG or SVG).")
    p.set_defaults(fn=cmd_layouts)
    p = sub.add_parser("bench", help="Time the train step; print one JSON line.")
    _common(p)
    p.add_argument("--steps", type=_whole(1), default=20, help="Timed steps per repeat.")
    p.add_argument("--warmup", type=_whole(0), default=3, help="Untimed steps first.")
    p.add_argument("--repeats", type=_whole(1), default=1, help="Repeat the timed steps.")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("doctor", help="Check this host's GPUs, driver, CUDA libraries and "
                       "TensorFlow build for a run of --config (exit 2 on an error); with "
                       "--report-dir, every node of a job (srun tfllm doctor ...) in one "
                       "report.")
    _common(p)
    p.add_argument("--report-dir", type=user_path, default=None, metavar="DIR",
                   help="A folder the job's nodes share: each rank writes its node's "
                        "findings there and rank 0 prints one report for the job "
                        "(tfllm.doctor.job).")
    p.add_argument("--rank", type=_whole(0), default=None,
                   help="--report-dir: this process's rank (default: SLURM_PROCID, "
                        "JOB_COMPLETION_INDEX or OMPI_COMM_WORLD_RANK).")
    p.add_argument("--world-size", type=_whole(1), default=None,
                   help="--report-dir: the job's ranks (default: SLURM_NTASKS or "
                        "OMPI_COMM_WORLD_SIZE).")
    p.add_argument("--ports", default=None, metavar="P1,P2,...",
                   help="--report-dir: ports the job's workers will bind on this node, "
                        "checked free there and reached from client 0 (default: this "
                        "rank's DTENSOR_JOBS port under tfllm launch, else the launcher's "
                        "first ports, one per task on the node; 0: a free one).")
    p.add_argument("--wait-s", type=_whole(1), default=120,
                   help="--report-dir: how long rank 0 waits for the other reports.")
    p.set_defaults(fn=cmd_doctor)
    p = sub.add_parser("plan", help="Compile the train step for a GPU target (no GPU "
                       "needed); print memory, kernels and a step-time estimate.")
    _common(p)
    p.add_argument("--target", default="h100", choices=("h100", "h200", "b200", "a100"),
                   help="The GPU to compile for (default h100).")
    p.add_argument("--devices", type=_whole(1), default=None,
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
    p.add_argument("--out", type=user_path, required=True, help="Output directory.")
    p.add_argument("--check", action="store_true",
                   help="Also save one step's inputs and TensorFlow's outputs (check.npz).")
    p.set_defaults(fn=cmd_export_step)
    for name, p in sub.choices.items():
        if name != "launch":  # also after the command; SUPPRESS: `tfllm --debug X` stands
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                           help=_DEBUG_HELP)
    return parser


_DEBUG_HELP = "On a failure, print Python's traceback before the one-line message."


#: (module, class) of the errors tfllm raises for bad input (config, mesh, rules, data,
#: checkpoint, peers, pretrained folders)
INPUT_ERROR_CLASSES = (
    ("tfllm.config.loader", "ConfigError"),
    ("tfllm.runtime.devices", "MeshError"),
    ("tfllm.parallel.rules", "ShardingError"),
    ("tfllm.data.errors", "DataError"),
    ("tfllm.checkpoint.shards", "CheckpointError"),
    ("tfllm.runtime.coordination", "ClientMismatchError"),
    ("tfllm.families", "PretrainedError"),
)


def _input_errors() -> tuple:
    """Errors caused by bad input (config, data, checkpoint, workdir): exit 2, no trace.

    Only the classes of modules already imported: an error of any other cannot have been
    raised, and a refusal before the model is built need not import TensorFlow.
    """
    tfllm_errors = tuple(getattr(sys.modules[module], name)
                         for module, name in INPUT_ERROR_CLASSES if module in sys.modules)
    return (InputError, *tfllm_errors, FileNotFoundError, IsADirectoryError,
            NotADirectoryError, PermissionError)


def _one_line(error: BaseException) -> str:
    """An error's message on one line (a multi-line message's lines joined)."""
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text or type(error).__name__


#: errno values that mean a path given is one the system refuses: bad input (exit 2)
_BAD_PATH_ERRNOS = frozenset((errno.ENAMETOOLONG, errno.ELOOP))


def _failure(error: BaseException, args):
    """(exit code, one line) for a failure the user can fix; None for a bug."""
    prefix = f"tfllm {args.command}: error: "
    failed = io_failure(error)
    if failed is not None:  # first: a failed save is also a CheckpointError
        after = (_latest_checkpoint(args.workdir) + "; free space or fix the permissions, "
                 "then run the same command to resume" if args.command == "train" else
                 "Free space or fix the permissions, then run the command again")
        # a write that names no path: the folder the command writes (an export's --out)
        written = getattr(args, "out", None) or getattr(args, "workdir", None)
        flag = "--out " if getattr(args, "out", None) else ""
        where = (f" (writing under {flag}{written})" if written and not failed.filename
                 and str(written) not in str(error) else "")
        return IO_ERROR_EXIT_CODE, f"{prefix}{_one_line(error)}{where}. {after}."
    if (isinstance(error, OSError) and error.errno == errno.ELOOP and error.filename
            and os.path.islink(str(error.filename))):  # a link planted at tfllm's own name
        return BAD_INPUT_EXIT_CODE, (f"{prefix}{error.filename} is a symbolic link where "
                                     "tfllm writes its own file (it writes no links and "
                                     "never through one): remove the link, then run the "
                                     "command again.")
    if isinstance(error, OSError) and error.errno in _BAD_PATH_ERRNOS:
        name = str(error.filename)
        name = name if len(name) <= 80 else f"{name[:60]}... ({len(name)} characters)"
        return BAD_INPUT_EXIT_CODE, (f"{prefix}{name}: {error.strerror}; give a path the "
                                     "system accepts (each name at most 255 bytes, no "
                                     "symbolic link loop).")
    if isinstance(error, _input_errors()):
        return BAD_INPUT_EXIT_CODE, prefix + _one_line(error)
    return None


@contextlib.contextmanager
def _terminate_as_interrupt(command: str):
    """SIGTERM as Ctrl-C for the commands other than train (which has its own watcher):
    an export or import interrupted by a scheduler or `kill` unwinds, removing its own
    temporary folder, instead of dying with it left behind."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    previous = None
    if command != "train":
        try:
            previous = signal.signal(signal.SIGTERM, interrupt)
        except ValueError:  # not the main thread (a notebook's worker): left as it is
            pass
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    """The `tfllm` command; returns its exit code.

    Every failure the user can fix (a bad argument, config, file or checkpoint; a full
    disk) is one line on stderr and a documented exit code (README, "Checkpoints, resume
    and exit codes"); only a bug, or `--debug`, prints a traceback.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"] or argv[:2] == ["--debug", "launch"]:
        # its own options (a launcher parses no tfllm flags)
        from tfllm.launch.main import main as launch
        return launch(argv[argv.index("launch") + 1:], "tfllm launch")
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # named with the command, not as the top-level parser's error
            parser.prog = f"tfllm {args.command}"
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # --help (0), or a bad argument already said on one line
        return e.code if isinstance(e.code, int) else BAD_INPUT_EXIT_CODE
    try:
        with _terminate_as_interrupt(args.command):
            return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C outside training (which saves and exits 75)
        print(f"tfllm {args.command}: interrupted", file=sys.stderr)
        return HARD_STOP_EXIT_CODE
    except Exception as error:
        files.remove_empty_folders(getattr(args, "created", []))  # nothing written after all
        failure = _failure(error, args)
        if failure is None:
            raise  # a bug: Python's traceback is the report
        if args.debug:
            traceback.print_exc()
        print(failure[1], file=sys.stderr, flush=True)
        return failure[0]


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
