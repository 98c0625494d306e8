"""`evaluate_tasks`: lm-evaluation-harness tasks scored on a restored run, the results
written into the run (`tfllm eval --tasks`).

Tasks are found by name (or glob) among tfllm's shipped tasks (`tfllm/evals/tasks`), the
folders of `include_paths`, then lm-eval's own catalogue (indexed only when a name is
not found in the first two: indexing its ~15,000 YAML files takes tens of seconds), or
given as the path of a task YAML. lm-eval's `evaluate` does the rest as its own CLI does:
few-shot contexts, requests, metrics. `limit` and `num_fewshot` mean what lm-eval's
`--limit` and `--num_fewshot` mean. The results (lm-eval's results JSON, and with
`log_samples` each task's samples as JSON lines) go to WORKDIR/eval.
"""

from __future__ import annotations

import datetime
import json
import os
import random
from typing import List, Optional, Sequence

import numpy as np
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable

from tfllm import files
from tfllm.contracts import InputError, client_id
from tfllm.evals.lm import TfllmLM
from tfllm.runpaths import RunPaths

#: the small local tasks tfllm ships (multiple choice, generation, perplexity)
SHIPPED_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
#: lm-eval's default seeds (simple_evaluate): the few-shot examples a task draws, and any
#: sampling, are the same as in an lm-eval run with the same settings
FEWSHOT_SEED, RANDOM_SEED, NUMPY_SEED = 1234, 0, 1234


def task_manager(names: Sequence[str], include_paths: Sequence[str] = ()) -> TaskManager:
    """The lm-eval `TaskManager` that knows every task of `names`.

    Raises:
      InputError: a name no folder holds, or a task YAML that cannot be read (one line).
    """
    for path in include_paths:
        if not os.path.isdir(path):
            raise InputError(f"--include-path {path}: not a folder; give a folder of lm-eval "
                             "task YAML files.")
    paths = [SHIPPED_TASKS, *include_paths]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if all(_known(manager, n) for n in names):
        return manager
    manager = TaskManager(include_path=paths)  # lm-eval's own catalogue too
    missing = [n for n in names if not _known(manager, n)]
    if missing:
        raise InputError(f"--tasks {','.join(missing)}: no such task in tfllm's tasks "
                         f"({SHIPPED_TASKS}), --include-path or lm-eval's; give a task "
                         "name, a glob (mmlu_*) or a task YAML file.")
    return manager


def _known(manager: TaskManager, name: str) -> bool:
    if name.endswith((".yaml", ".yml")):
        if not os.path.isfile(name):
            raise InputError(f"--tasks {name}: no such task file.")
        return True
    return bool(manager.match_tasks([name]))


def load_tasks(manager: TaskManager, names: Sequence[str]) -> dict:
    """lm-eval's loaded tasks ({"tasks", "groups", "group_map"}): each task's documents
    read from its data files.

    Raises:
      InputError: a task whose definition or data cannot be read (one line naming it).
    """
    specs: List[str] = []
    for name in names:
        specs += [name] if name.endswith((".yaml", ".yml")) else manager.match_tasks([name])
    try:
        return manager.load(specs)
    except Exception as e:  # noqa: BLE001 (YAML, datasets and lm-eval each raise their own)
        detail = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise InputError(f"--tasks {','.join(names)}: a task could not be loaded "
                         f"({type(e).__name__}: {detail or 'no message'}); check the task "
                         "YAML and its data files (dataset_path: json with data_files, "
                         "read offline when HF_DATASETS_OFFLINE=1).") from None


def evaluate_tasks(run, names: Sequence[str], num_fewshot: Optional[int] = None,
                   limit: Optional[float] = None, batch_size: int = 8,
                   include_paths: Sequence[str] = (), apply_chat_template: bool = False,
                   log_samples: bool = False, add_bos_token: bool = False,
                   bootstrap_iters: int = 100_000, loaded: Optional[dict] = None,
                   step: Optional[int] = None) -> dict:
    """lm-eval's results of `names` on a restored run, written into its workdir.

    Args:
      run: a restored inference `Run` (`tfllm.train.saved_run.restored_run`).
      names: task names, globs or task YAML paths.
      num_fewshot: few-shot examples per context (None: each task's own, else 0).
      limit: documents per task (a fraction of them when below 1); None: all.
      batch_size: requests per forward pass or generation batch.
      include_paths: folders of task YAML files to search too.
      apply_chat_template: render contexts with the run's chat template (each few-shot
        example a turn, as lm-eval's fewshot_as_multiturn).
      log_samples: also write each task's samples (prompts, answers, per-sample
        log-likelihoods and metrics) as JSON lines.
      add_bos_token: put the tokenizer's BOS before every request (`TfllmLM`).
      bootstrap_iters: resamples for the stderr of non-mean metrics (lm-eval's; 0: none).
      loaded: the tasks already loaded (`load_tasks`); None: loaded here.
      step: the checkpoint's step, recorded with the results.

    Returns:
      lm-eval's results dict ("results", "configs", "n-shot", "samples", ...), with
      "files": the paths written (client 0 only writes).
    """
    if loaded is None:
        loaded = load_tasks(task_manager(names, include_paths), names)
    random.seed(RANDOM_SEED)
    np.random.seed(NUMPY_SEED)
    for task in loaded["tasks"].values():  # as lm-eval's simple_evaluate sets them
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    lm = TfllmLM(run, batch_size=batch_size, add_bos_token=add_bos_token)
    results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters,
                       log_samples=True, apply_chat_template=apply_chat_template,
                       fewshot_as_multiturn=apply_chat_template)
    m = run.config.mesh
    results["config"] = {"model": "tfllm", "workdir": run.workdir, "step": step,
                         "mesh": m.axes, "precision": run.config.precision.policy,
                         "batch_size": batch_size, "limit": limit,
                         "num_fewshot": num_fewshot, "bootstrap_iters": bootstrap_iters,
                         "add_bos_token": add_bos_token,
                         "apply_chat_template": apply_chat_template,
                         "random_seed": RANDOM_SEED, "numpy_seed": NUMPY_SEED,
                         "fewshot_seed": FEWSHOT_SEED}
    results["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    results["files"] = write_results(run.workdir, results, log_samples) \
        if run.workdir and client_id() == 0 else []
    return results


def write_results(workdir: str, results: dict, log_samples: bool) -> List[str]:
    """Writes WORKDIR/eval/results_<time>.json (lm-eval's results, samples left out) and,
    with `log_samples`, samples_<task>_<time>.jsonl per task (lm-eval's file names)."""
    folder = RunPaths(workdir).eval_dir
    files.make_dirs(workdir, folder)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%S.%f")
    written = [os.path.join(folder, f"results_{stamp}.json")]
    aggregated = {k: v for k, v in results.items() if k not in ("samples", "files")}
    files.write_atomically(workdir, written[0], _dumps(aggregated, indent=2) + "\n")
    for task, samples in (results.get("samples") or {}).items() if log_samples else ():
        path = os.path.join(folder, f"samples_{task}_{stamp}.jsonl")
        files.write_atomically(workdir, path,
                               "".join(_dumps(s) + "\n" for s in samples))
        written.append(path)
    return written


def _dumps(value, indent=None) -> str:
    return json.dumps(value, indent=indent, default=handle_non_serializable,
                      ensure_ascii=False)
