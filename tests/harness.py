"""The shared test harness: tiny configs, the parity harness, and real processes.

Plain public functions that tests import (`from tests.harness import tiny_config`);
tests/conftest.py keeps only the pytest fixtures and hooks (and splits the CPU into
the 8 logical devices the sharded helpers here run on: it is loaded before any test
module, and a script that uses these helpers outside pytest imports `tests.conftest`
first).

* Configs: `tiny_overrides`, `tiny_config`, `text_overrides`, `tiny_text_config`,
  `write_text_corpus`, `sections` (what `build_model` takes of a config).
* Costs: `first_step_costs` (the first step's cost report and executed graphs).
* Parity: `parity_run` (one training run, sharded or not), `parity_reference` (the
  single-device float32 run, cached per process), `assert_parity` (their agreement
  within the float32 tolerances justified below).
* Processes: `run_tfllm` (`python -m tfllm.cli.main ...` to completion), `start_process`,
  `finish`, `kill_group` (a child in its own process group, a hard
  timeout, nothing left behind), `run_clients` (N real DTensor clients),
  `run_in_child` (a test alone in a fresh pytest process), `train_with_xla_dump`,
  `shared_xla_dump` (the same, once per session).
* Once per session, for every pytest-xdist worker: `once_per_session`, `session_dir`,
  `session_key`.
* Cluster software: `fake_cluster_tools` (stand-ins for Slurm's and ssh's commands that
  tests/conftest.py puts first on PATH for every test), `CLUSTER_TOOLS`.
* Small shared pieces: `free_ports`, `snapshot_tree`, `metrics_records`,
  `forward_on_mesh`.
"""

import ast
import functools
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


# ---- configs -------------------------------------------------------------------------------
def tiny_overrides(family="gpt", axes="data=1", **extra):
    """--set overrides for the test model: vocab 128, hidden 64, 2 layers.

    Llama gets 16 query / 8 key-value heads so that grouped-query attention is exercised
    and both divide over model=8; GPT gets 8 heads.

    Args:
      family: "gpt", "llama" or "gemma3".
      axes: the mesh (`mesh.axes`), e.g. "data=2,model=4".
      **extra: more settings by dotted key, e.g. `**{"precision.policy": "fp8"}`; they
        replace the defaults above.

    Returns:
      A list of "key=value" strings, as `--set` and `load_config` take them.
    """
    heads = {"gpt": (8, 0), "llama": (16, 8), "gemma3": (16, 8)}[family]
    values = {
        "model.family": family, "model.vocab_size": 128, "model.hidden_dim": 64,
        "model.num_layers": 2, "model.num_query_heads": heads[0],
        "model.num_key_value_heads": heads[1], "model.intermediate_dim": 128,
        "model.max_sequence_length": 32, "data.sequence_length": 16,
        "train.global_batch_size": 16, "train.steps": 3, "optimizer.warmup_steps": 1,
        "optimizer.learning_rate": 1e-2, "mesh.axes": axes, "data.source": "synthetic",
    }
    if family == "gemma3":  # a local (window 5 < 16 tokens) and a global layer
        values.update({"model.sliding_window": 5, "model.sliding_window_pattern": 2,
                       "model.rope_local_theta": 10000.0, "model.rope_theta": 1e6,
                       "model.query_pre_attn_scalar": 24.0})
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def tiny_config(family="gpt", axes="data=1", **extra):
    """The Config of the test model: `tiny_overrides(...)` loaded over the defaults.

    Args:
      family: "gpt", "llama" or "gemma3".
      axes: the mesh (`mesh.axes`).
      **extra: more settings by dotted key, e.g. `**{"precision.policy": "fp8"}`.
    """
    from tfllm.config import load_config
    overrides = tiny_overrides(family, axes, **extra)
    return load_config(None, overrides)


def sections(config):
    """The sections of `config` that `tfllm.models.build_model` reads: model, precision,
    lora (`build_model(*sections(cfg), parallel=...)`; the seed is passed on its own)."""
    return config.model, config.precision, config.lora


def write_text_corpus(directory, files=4, docs_per_file=12, seed=0):
    """Small multi-line text files whose documents are separated by <|endoftext|>.

    Args:
      directory: a pathlib.Path, created if missing.
      files: how many files.
      docs_per_file: documents per file.
      seed: the words' random seed.

    Returns:
      The glob pattern of the files (for `data.paths`).
    """
    import random
    rng = random.Random(seed)
    words = "the cat sat on a mat and the dog ran to the park with a red ball".split()
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        docs = ["\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(8))
                for _ in range(docs_per_file)]
        (directory / f"f{f}.txt").write_text("<|endoftext|>".join(docs))
    return str(directory / "*.txt")


def text_overrides(tmp_path, axes="data=2,model=4", **extra):
    """tiny_overrides for a byte-tokenized run on write_text_corpus files.

    Args:
      tmp_path: a folder for the corpus (`corpus/`) and the data cache (`cache/`).
      axes: the mesh.
      **extra: more settings by dotted key.
    """
    pattern = write_text_corpus(tmp_path / "corpus")
    values = {"data.source": "text", "data.paths": f'["{pattern}"]', "data.tokenizer": "byte",
              "model.vocab_size": 260, "data.validation_fraction": 0.2,
              "data.data_dir": str(tmp_path / "cache"), "train.eval_steps": 2,
              "train.sample_tokens": 0}
    values.update(extra)
    return tiny_overrides("gpt", axes, **values)


def tiny_text_config(tmp_path, axes="data=2,model=4", **extra):
    """The Config of `text_overrides(...)` loaded over the defaults."""
    from tfllm.config import load_config
    return load_config(None, text_overrides(tmp_path, axes, **extra))


def first_step_costs(axes, layers, policy="float32", family="llama", **extra):
    """(cost report, executed graphs) of the first training step of the tiny model
    (`tiny_config`) with `layers` blocks on mesh `axes`, in graph mode.

    Args:
      axes: the mesh.
      layers: model.num_layers (compare 2 and 3 to see what one block costs).
      policy: precision.policy.
      family: the model family.
      **extra: more settings by dotted key.
    """
    from unittest import mock

    from tfllm.compiler import costs
    from tfllm.compiler.reports import FirstCall
    from tfllm.data import SyntheticTokens, feed
    from tfllm.parallel import make_parallel
    from tfllm.train.state import build_train_state
    cfg = tiny_config(family, axes, **{"precision.policy": policy,
                                       "model.num_layers": layers}, **extra)
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    state = build_train_state(cfg, parallel, jit_compile=False)
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=7)
    seen, report, first = [], costs.report_from_graphs, FirstCall(parallel, False)
    with mock.patch.object(costs, "report_from_graphs",
                           lambda graphs, *a, **k: seen.extend(graphs) or report(graphs, *a, **k)):
        state.step(feed.to_device(parallel, data.batch(0, cfg.train.global_batch_size,
                                                       cfg.train.grad_accum_steps)),
                   reader=first)
    return first.report.costs, seen


def train_step_dots(cfg):
    """The dots of `cfg`'s XLA-compiled train step on one device without DTensor
    (get_compiler_ir needs plain tensors), as `tfllm.compiler.fp8_hlo.classify_dots` sees
    them: which run in FP8 (`kind == "full"`), which mix FP8 and other operands."""
    from tfllm.compiler.fp8_hlo import classify_dots
    from tfllm.data import SyntheticTokens, feed
    from tfllm.train.state import build_train_state
    step = build_train_state(cfg, None, jit_compile=True).step
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1)
    batch = feed.to_device(None, data.batch(0, cfg.train.global_batch_size))
    hlo = step.compiled.experimental_get_compiler_ir(
        batch, feed.place(None, np.float32(float("inf")), ()))(stage="hlo")
    return classify_dots(hlo)


def graph_ancestors(graph, name):
    """The names of every node `name` depends on (data and control inputs) in a GraphDef."""
    nodes = {n.name: n for n in graph.node}
    seen, todo = set(), [name]
    while todo:
        for i in nodes[todo.pop()].input:
            i = i.lstrip("^").split(":")[0]
            if i in nodes and i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


# ---- the parity harness -----------------------------------------------------------------
PARITY_STEPS = 3

# Tolerances. float32 has a unit roundoff of 6e-8; a sharded run reorders sums of at
# most a few thousand terms (hidden 64 x batch 16 x length 16), whose rounding error
# grows like sqrt(n) * eps relative to the summed magnitudes: about 1e-6 relative.
# Losses are means of well-conditioned positives: rtol 1e-5 leaves a 10x margin.
LOSS_RTOL = 1e-5
# Gradients: entries near zero carry absolute, not relative, error, so the absolute
# tolerance is 1e-5 of the largest gradient entry of that variable (10x the estimate),
# floored at 1e-6 of the largest entry of any variable: some gradients are zero in exact
# arithmetic (the key bias: softmax ignores a shift shared by all keys) and are pure
# rounding noise of the terms that cancel, which are of the model's gradient scale.
GRAD_RTOL, GRAD_ATOL_FRACTION, GRAD_ATOL_FLOOR = 1e-4, 1e-5, 1e-6
# Weights after 3 steps: AdamW's update m / (sqrt(v) + eps) is scale-free, so a gradient
# entry that is zero up to rounding (key biases; ~1e-11 here) becomes an O(lr) update
# of random sign when eps is far below it: the default eps = 1e-8 turns 1e-11 noise into
# 1e-3 * lr. The parity runs therefore use eps = 1e-6, still 1000x below the gradient
# entries that matter (~1e-3), so it changes no real update but keeps rounding noise at
# <= 1e-5 * lr. For the other entries the update inherits the gradient's 1e-4 relative
# error: 3 steps x lr (1e-2) x 1e-4 x |update| (<= ~3 with bias correction) < 1e-5.
# Entries whose gradient is small but not rounding noise (~5e-4 of the variable's
# largest: gemma3's block_1 key kernel [42, 2, 1], -5.15e-6 against 1.0e-2) carry a
# relative error near 1e-3 after reordered sums, and AdamW's normalized update turns it
# into up to 1e-3 x lr x 3 steps = 3e-5 (measured: 2.02e-5 on data=2,fsdp=2,model=2 once
# block-level gradient reductions changed the summation order).
WEIGHT_ATOL = 3e-5
PARITY_SETTINGS = (("optimizer.epsilon", 1e-6),)


def parity_config(family, axes=None, extra=()):
    """The Config of a parity run (the tiny model with PARITY_SETTINGS).

    Args:
      family: the model family.
      axes: the mesh; None: one device without DTensor.
      extra: more settings, as ((dotted key, value), ...).
    """
    return tiny_config(family, "data=1" if axes is None else axes,
                       **dict(PARITY_SETTINGS + tuple(extra)))


def parity_run(family, axes, jit, extra=(), grads=True):
    """One batch's loss and gradients, then PARITY_STEPS AdamW steps, as `tfllm train`
    builds them.

    Args:
      family: the model family.
      axes: the mesh; None: one device without DTensor (the reference).
      jit: compile the step with XLA; on a mesh, also checks that XLA really compiled
        it on every device.
      extra: more settings, as ((dotted key, value), ...).
      grads: also compute the first batch's loss and gradients with `loss_and_grads`, a
        program of their own (under XLA, a compile of its own: the step's program is
        checked through its losses, gradient norms and weights).

    Returns:
      A dict: loss, grads (per trainable variable; both None without `grads`), history
      (each step's metrics),
      weights ({path: numpy}), paths, model, optimizer, parallel (None on one device).
    """
    from tfllm.compiler.reports import FirstCall
    from tfllm.data import SyntheticTokens, feed
    from tfllm.parallel import make_parallel
    from tfllm.parallel.placement import to_numpy
    from tfllm.train.state import build_train_state
    single = axes is None
    cfg = parity_config(family, axes, extra)
    parallel = None if single else make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    state = build_train_state(cfg, parallel, jit)  # what `tfllm train` builds
    model, optimizer, step = state.model, state.optimizer, state.step
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=7)
    t = cfg.train
    batch = lambda i: feed.to_device(parallel, data.batch(i, t.global_batch_size,  # noqa: E731
                                                          t.grad_accum_steps))
    loss, first_grads = step.loss_and_grads(batch(0)) if grads else (None, None)
    first = FirstCall(parallel, jit)  # the first step's report: what XLA compiled
    history = [step(batch(i), reader=first if i == 0 else None) for i in range(PARITY_STEPS)]
    if jit and not single:
        # XLA really compiled the step on every device (not only the flag was passed).
        report = first.report.xla
        assert report.clusters >= 1 and len(report.devices) == parallel.mesh.num_local_devices()
        assert report.core_outside() == {}, report.examples
    weights = {v.path: to_numpy(v) for v in model.trainable_variables}
    return {"loss": loss, "grads": first_grads, "history": history, "weights": weights,
            "paths": [v.path for v in model.trainable_variables], "model": model,
            "optimizer": optimizer, "parallel": parallel,
            "costs": first.report.costs if first.report is not None else None}


@functools.lru_cache(maxsize=None)
def parity_reference(family, jit, extra=(), grads=True):
    """The single-device float32 `parity_run`, computed once per process.

    Args:
      family: the model family.
      jit: compile the step with XLA.
      extra: more settings, as a hashable ((dotted key, value), ...).
      grads: also the first batch's loss and gradients (see `parity_run`).
    """
    return parity_run(family, None, jit, extra, grads)


def assert_parity(run, ref):
    """`run` equals `ref` (both from parity_run) within the float32 tolerances above:
    loss and gradients of the first batch (when both computed them), each step's loss,
    gradient norm and learning rate, and every weight after the steps.

    Args:
      run: the run under test (usually sharded).
      ref: the reference (usually `parity_reference(...)`).
    """
    assert (run["grads"] is None) == (ref["grads"] is None), "both with grads, or neither"
    if run["grads"] is not None:
        np.testing.assert_allclose(run["loss"], ref["loss"], rtol=LOSS_RTOL)
        scale = max(float(np.abs(g).max()) for g in ref["grads"])
        for path, g, g_ref in zip(ref["paths"], run["grads"], ref["grads"]):
            atol = max(GRAD_ATOL_FRACTION * float(np.abs(g_ref).max()),
                       GRAD_ATOL_FLOOR * scale)
            np.testing.assert_allclose(g, g_ref, rtol=GRAD_RTOL, atol=atol, err_msg=path)
    for got, want in zip(run["history"], ref["history"]):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=LOSS_RTOL)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=LOSS_RTOL)
        assert got["learning_rate"] == want["learning_rate"]
    for path, w in ref["weights"].items():
        np.testing.assert_allclose(run["weights"][path], w, rtol=0, atol=WEIGHT_ATOL,
                                   err_msg=path)


def forward_on_mesh(model, parallel, tokens, segments):
    """The model's logits for packed rows, under XLA on its mesh (batch-sharded inputs).

    Args:
      model: a model built on `parallel`.
      parallel: its Parallel.
      tokens: int32 numpy [batch, length].
      segments: int32 numpy segment ids, the same shape.

    Returns:
      The gathered logits, numpy.
    """
    import tensorflow as tf
    from tfllm.data import feed
    from tfllm.parallel import context
    from tfllm.parallel.placement import to_numpy

    @tf.function(jit_compile=True)
    def forward(t, s):
        with context.use(parallel):
            return model(t, segment_ids=s)

    return to_numpy(forward(feed.place(parallel, tokens), feed.place(parallel, segments)))


# ---- hang bounds ---------------------------------------------------------------------------
# A timeout in a test only bounds a hang: it never decides whether a working program passes
# (issue 47). Each is at least ~5x the slowest time of what it bounds on 2 cores under load
# (the suite under `pytest -n 2` beside two CPU-bound processes: 2-3x its time alone), and
# below the slow tier's per-test timeout (tests/tiers.py), which would otherwise fire first.
#: processes that import TensorFlow (5-10 s alone, ~30 s loaded) and build a mesh, train,
#: evaluate or compile a few steps: up to ~1 minute under -n 2 (docs/testing.md's slowest).
TF_HANG_S = 900
#: one long TensorFlow process: a whole test in a child pytest (a parity case under XLA
#: took 109 s under -n 2), the planner's measured steps.
LONG_TF_HANG_S = 1500


# ---- real processes ----------------------------------------------------------------------
def tfllm_command(*args):
    """The argv of `python -m tfllm.cli.main ARGS` with this interpreter."""
    return [PY, "-m", "tfllm.cli.main", *args]


def tfllm_env(**extra):
    """This process's environment with TensorFlow's C++ logs off (TF_CPP_MIN_LOG_LEVEL=3).

    Args:
      **extra: variables to set on top, e.g. PYTHONPATH=ROOT.
    """
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **extra)


def run_tfllm(*args, timeout=TF_HANG_S, env=None, cwd=ROOT):
    """Runs `python -m tfllm.cli.main ARGS` to completion, output captured as text.

    Args:
      *args: the command line after `tfllm`.
      timeout: seconds before subprocess.TimeoutExpired.
      env: the child's whole environment; None: `tfllm_env()`.
      cwd: its working directory (the repository, where configs/ is).

    Returns:
      The subprocess.CompletedProcess (returncode, stdout, stderr).
    """
    return subprocess.run(tfllm_command(*args), cwd=cwd, env=tfllm_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


def start_process(cmd, env=None, cwd=ROOT, merge_stderr=False):
    """Starts `cmd` in its own process group, so that `kill_group` reaps it and all it
    started.

    Args:
      cmd: the argv.
      env: the child's whole environment; None: this process's.
      cwd: its working directory.
      merge_stderr: stderr into stdout (one stream, in order).

    Returns:
      The subprocess.Popen (text pipes).
    """
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=True)


# A shell loop, not this process: a pytest worker can stall for a minute (the suite has
# seen 126 s inside garbage collection), long enough for a short training to finish
# before a signal meant for its third step; the watcher does nothing else.
_SIGNAL_AT_STEP = r"""
metrics=$1; step=$2; sig=$3; target=$4
while :; do
  last=$(grep '"loss"' "$metrics" 2>/dev/null | grep -o '"step": *[0-9]*' \
         | grep -o '[0-9]*$' | sort -n | tail -1)
  [ -n "$last" ] && [ "$last" -ge "$step" ] && break
  sleep 0.02
done
case $target in
  *:*) pid=$(awk -v r="${target##*:}" '$1 == r {print $2}' "${target%:*}") ;;
  *) pid=$target ;;
esac
kill -s "$sig" "$pid"
"""


def signal_at_step(metrics, step, sig, target):
    """Starts a watcher that sends `sig` once `metrics` (a run's metrics.jsonl) logs the
    loss of step `step` or later; kill_group it when done.

    Args:
      metrics: the metrics.jsonl path.
      step: the step to wait for.
      sig: a signal.Signals.
      target: a pid, or "PIDS_FILE:RANK" (the launcher's logs/pids, read when the step is
        reached).
    """
    return subprocess.Popen(["bash", "-c", _SIGNAL_AT_STEP, "signal_at_step", str(metrics),
                             str(step), sig.name[3:], str(target)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def kill_group(proc):
    """SIGKILLs `proc`'s process group (a no-op when it is gone) and reaps `proc`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait()


def finish(proc, timeout):
    """Waits for `proc`; SIGKILLs its process group if it is still there (timeout or not).

    Args:
      proc: from `start_process` (its own process group).
      timeout: seconds before subprocess.TimeoutExpired (the group is killed first).

    Returns:
      (exit code, stdout, stderr); stderr is None for a merged stream.
    """
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, out, err


# ---- cluster software: fakes first on PATH ------------------------------------------------
# The commands of Slurm and OpenSSH that tfllm or its launcher may run. A machine that has a
# real Slurm or sshd (the real-cluster tests install one) must not change what the other
# tests do: tests/conftest.py puts these fakes first on PATH for the whole session.
CLUSTER_TOOLS = ("srun", "sbatch", "salloc", "scontrol", "scancel", "squeue", "sinfo", "ssh", "scp")
FAKE_TOOL_EXIT = 97  # what a fake returns for a call it does not fake

_FAKE_SCONTROL = """#!{python}
# A stand-in for Slurm's scontrol: `scontrol show hostnames LIST` as tfllm's own expansion
# (the answer the tests expect); any other call fails as the other fakes do.
import sys
sys.path.insert(0, {root!r})
with open({calls!r}, "a") as f:
    f.write(" ".join(["scontrol", *sys.argv[1:]]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"] and len(sys.argv) == 4:
    from tfllm.launch.topology import expand_nodelist
    print("\\n".join(expand_nodelist(sys.argv[3])))
    sys.exit(0)
print("fake scontrol: tests fake only 'show hostnames LIST', not:", *sys.argv[1:], file=sys.stderr)
sys.exit({code})
"""

_FAKE_TOOL = """#!/bin/sh
# A stand-in for {tool}: a test reached a cluster tool it did not fake.
echo "{tool} $*" >> '{calls}'
echo "fake {tool}: tests never run the real {tool}; pass a fake explicitly (called with: $*)" >&2
exit {code}
"""


def fake_cluster_tools(directory):
    """Writes a bin directory of stand-ins for `CLUSTER_TOOLS` into `directory`.

    `scontrol show hostnames LIST` answers with tfllm's own expansion; every other call,
    and every other tool, prints one line naming the tool and exits `FAKE_TOOL_EXIT`. Each
    call is appended to the file `calls` beside the bin directory.

    Args:
      directory: an existing folder (a test's or the session's tmp path).

    Returns:
      (the bin directory to put first on PATH, the calls file).
    """
    bin_dir = os.path.join(str(directory), "cluster-bin")
    calls = os.path.join(str(directory), "calls")
    os.makedirs(bin_dir, exist_ok=True)
    for tool in CLUSTER_TOOLS:
        text = (_FAKE_SCONTROL.format(python=PY, root=ROOT, calls=calls, code=FAKE_TOOL_EXIT)
                if tool == "scontrol" else
                _FAKE_TOOL.format(tool=tool, calls=calls, code=FAKE_TOOL_EXIT))
        path = os.path.join(bin_dir, tool)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
    return bin_dir, calls


def free_ports(n):
    """n free localhost TCP ports (for DTENSOR_JOBS in multi-client tests)."""
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_clients(cmd, clients=2, timeout=TF_HANG_S, env=None):
    """Runs `clients` real DTensor clients of `cmd` on localhost ports, each in its own
    process group; asserts that each exits 0; a hung client (e.g. a barrier never met)
    never outlives the call.

    Args:
      cmd: every client's argv.
      clients: how many (DTENSOR_CLIENT_ID 0..clients-1, DTENSOR_JOB_NAME=worker).
      timeout: seconds each client may take.
      env: variables added to `tfllm_env(PYTHONPATH=ROOT)`.

    Returns:
      Each client's last output line, parsed as JSON.
    """
    jobs = ",".join(f"localhost:{p}" for p in free_ports(clients))
    base = tfllm_env(PYTHONPATH=ROOT, DTENSOR_JOBS=jobs, DTENSOR_JOB_NAME="worker",
                     **(env or {}))
    procs = [start_process(cmd, dict(base, DTENSOR_CLIENT_ID=str(i)), merge_stderr=True)
             for i in range(clients)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


# XLA on CPU maps executable code per compiled cluster and per device, and TensorFlow
# never frees compiled clusters: a process that compiles the 8-device parity meshes
# exhausts the kernel's vm.max_map_count (65,530 mappings; measured ~6,500 per llama
# parity case) and segfaults. Such tests run in a child pytest process of their own.
IN_CHILD = "TFLLM_TEST_IN_CHILD"


def run_in_child(request, timeout=LONG_TF_HANG_S, env=None):
    """Runs the calling test alone in a fresh pytest process; True if this is that child.

    Usage: `if not run_in_child(request): return` at the top of a test.

    Args:
      request: the test's pytest `request` fixture.
      timeout: seconds the child may take.
      env: variables added to the child's environment (e.g. XLA_FLAGS, read once per
        process).
    """
    if os.environ.get(IN_CHILD):
        return True
    env = dict(os.environ, **(env or {}), **{IN_CHILD: "1"})
    out = subprocess.run([PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          request.node.nodeid], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout[-6000:] + out.stderr[-3000:])
    return False


XLA_TRAIN_TIMEOUT_S = TF_HANG_S  # bounds a hang only (see TF_HANG_S)


def train_with_xla_dump(tmp_path, axes, extra=(), dump=True):
    """Runs `tfllm train` (configs/tiny.yaml, 2 steps, XLA on) in a process, dumping the
    HLO modules XLA compiles to `tmp_path/xla_dump`.

    Args:
      tmp_path: the test's folder (the run's workdir is `run/` in it).
      axes: the mesh.
      extra: more command-line arguments, e.g. ["--set", "model.family=llama"].
      dump: dump the HLO (with LLVM at -O0: it only shortens CPU code generation).

    Returns:
      (the run's stdout, {file name: text} of the dumped *before_optimizations.txt).
    """
    dump_dir = tmp_path / "xla_dump"
    env = tfllm_env(PYTHONPATH=ROOT)
    env.pop("TF_XLA_FLAGS", None)  # a fresh workdir's own cache: every cluster compiles
    if dump:
        # The HLO read here is XLA's input; LLVM at -O0 only shortens CPU code generation.
        env["XLA_FLAGS"] = f"--xla_dump_to={dump_dir} --xla_backend_optimization_level=0"
    out = run_tfllm("train", "--config", "configs/tiny.yaml",
                    "--workdir", str(tmp_path / "run"), "--set", f"mesh.axes={axes}",
                    "--set", "train.jit_compile=true", "--set", "train.steps=2",
                    "--set", "train.log_every=1", "--set", "train.eval_steps=1",
                    "--set", "train.progress=lines", *extra,
                    timeout=XLA_TRAIN_TIMEOUT_S, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    modules = {os.path.basename(p): open(p).read()
               for p in glob.glob(str(dump_dir / "*before_optimizations.txt"))}
    return out.stdout, modules


def shared_xla_dump(tmp_path_factory, axes, extra=()):
    """`train_with_xla_dump` of these arguments once per test session: the run and its
    HLO are the same for every test that reads them (tests/train/test_xla.py and
    tests/plan/test_plan.py read the same fsdp=2 step), so whichever asks first runs it.

    Args:
      tmp_path_factory: pytest's session fixture.
      axes, extra: as `train_with_xla_dump`.

    Returns:
      (the run's stdout, {file name: text} of the dumped *before_optimizations.txt).
    """
    name = json.dumps(["train_with_xla_dump", axes, list(extra)])

    def make(directory):
        return train_with_xla_dump(directory, axes, extra)

    stdout, modules = once_per_session(tmp_path_factory, name, make)
    return stdout, modules


# ---- once per session ---------------------------------------------------------------------
def session_dir(tmp_path_factory, name):
    """A folder every pytest-xdist worker of this session shares (each worker's base
    temporary directory is popen-gwN inside the session's own).

    Args:
      tmp_path_factory: pytest's session fixture.
      name: the folder's name.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory = shared / name
    directory.mkdir(exist_ok=True)
    return directory


def session_key(value):
    """A short file name for a JSON-serializable value (sorted keys)."""
    import hashlib
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def once_per_session(tmp_path_factory, name, make):
    """`make(folder)`'s JSON-serializable result, computed once per test session.

    The first worker to ask runs it, holding a file lock; a worker that asks meanwhile
    waits for it (instead of running it too) and reads its result. For work that is a
    function of its arguments alone: a compiled step, a measured tiny run.

    Args:
      tmp_path_factory: pytest's session fixture.
      name: what is made, as a JSON-serializable value (its arguments included).
      make: called with a new folder of its own; returns the result.
    """
    import fcntl
    directory = session_dir(tmp_path_factory, "once")
    key = session_key(name)
    result = directory / f"{key}.json"
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            work = directory / key
            shutil.rmtree(work, ignore_errors=True)  # what a failed attempt left
            work.mkdir()
            value = make(work)
            result.with_suffix(".tmp").write_text(json.dumps(value))
            result.with_suffix(".tmp").rename(result)
    return json.loads(result.read_text())


# ---- files -------------------------------------------------------------------------------
def metrics_records(workdir):
    """The records of a run's metrics.jsonl, in order (one dict per line).

    Args:
      workdir: the run's folder (a pathlib.Path).
    """
    return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]


def snapshot_tree(directory):
    """Every file and folder under `directory`, with its content (None for a folder): what
    a refused command must leave unchanged."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = (
                open(path, "rb").read() if os.path.isfile(path) else None)
    return out


def wait_delivered(proc, sig, timeout_s=60):
    """Waits until `sig` is no longer pending for `proc`: its handler took it, so a next one
    cannot merge with it (a fixed sleep did not say so on a loaded machine). `timeout_s`
    bounds a hang only."""
    deadline = time.monotonic() + timeout_s
    bit = 1 << (int(sig) - 1)
    while proc.poll() is None:
        with open(f"/proc/{proc.pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f
                       if line.startswith(("SigPnd:", "ShdPnd:"))]
        if not any(p & bit for p in pending):
            return
        assert time.monotonic() < deadline, f"signal {sig} still pending after {timeout_s} s"
        time.sleep(0.01)


def dotted_name(node) -> str:
    """'os.path.join' for the expression os.path.join; '' when it is not a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""
