"""The training loop: resume, train, evaluate, checkpoint, stop cleanly, report.

`train(config, workdir)` is what `tfllm train` runs. It checks the workdir
(`tfllm.checkpoint.workdir`) and, before the first step, everything that could fail later
(`tfllm.train.preflight`); resumes from the workdir's latest committed checkpoint when
there is one, shows a progress bar (step, loss, tokens/s, MFU, ETA), appends to
metrics.jsonl and TensorBoard, evaluates every `train.eval_every` steps and at the end
(when there is validation data), saves every `checkpoint.every` steps and at the end
(before the final evaluation: nothing after the last step can lose it), draws loss.png,
and prints a generated sample. SIGTERM/SIGINT save and exit 75; a NaN/Inf loss exits 3
under `train.on_nonfinite=abort`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections import deque

from tfllm import files
from tfllm.checkpoint.lock import RunLock
from tfllm.checkpoint.workdir import (Workdir, check_tokenizer, check_workdir, start_run,
                                      tokenizer_fingerprint)
from tfllm.data.tokenizer import save_to_run
from tfllm.models.lora import summary_line as lora_summary
from tfllm.config.loader import to_dict
from tfllm.runtime.coordination import any_client
from tfllm.contracts import client_id, num_clients
from tfllm.parallel.placement import to_numpy
from tfllm.runtime.watchdog import PeerLost, PeerWatchdog, lost_message, peer_from_error
from tfllm.precision import describe
from tfllm.train import hlo_dump
from tfllm.train.metrics import Throughput, flops_per_token, mesh_peak
from tfllm.train.preemption import NonFiniteError, Preempted, SignalWatcher
from tfllm.train.preflight import no_validation_reason, preflight
from tfllm.train.progress import Progress
from tfllm.train.run import Run, sample_text
from tfllm.train.tensorboard import TensorBoard

__all__ = ["Run", "train"]


class _Outputs:
    """What client 0 writes: metrics.jsonl, TensorBoard, the progress display."""

    def __init__(self, workdir: Workdir, primary: bool, progress: Progress):
        self.primary, self.progress = primary, progress
        self.metrics_path = workdir.metrics_file
        # TensorFlow writes the event files by path: into a folder made here, no link
        self.tensorboard = (TensorBoard(files.make_dirs(workdir.path, workdir.tensorboard_dir))
                            if primary else None)
        # appended to, never through a link planted at the name
        self.file = (files.open_for_writing(workdir.path, self.metrics_path, "a", append=True)
                     if primary else None)

    def record(self, record: dict, model) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record["step"], record, model)

    def close(self):
        if self.file is not None:
            self.file.close()
        self.progress.close()


class _Releaser:
    """Releases the run's lock with the watchdogs (`stop`), on any exit of `train`."""

    def __init__(self, lock):
        self.lock = lock

    def stop(self):
        if self.lock is not None:
            self.lock.release()


def train(config, workdir: str, model_cls=None, out=None) -> dict:
    """Trains per `config` in `workdir`, resuming from its latest checkpoint.

    Args:
      config: a validated `tfllm.config.Config`.
      workdir: the run directory (created if missing).
      model_cls: optional `CausalLM` subclass.
      out: where the progress display goes (client 0 only); default: sys.stdout at
        the time of the call (not of the import, so redirections are honoured).

    Returns:
      The last logged metrics (plus eval results and `first_step_s`).

    Raises:
      Preempted: after saving, when a signal asked the run to stop.
      NonFiniteError: a NaN/Inf loss or gradient norm under on_nonfinite=abort.
    """
    out = sys.stdout if out is None else out
    with SignalWatcher() as signals:  # from the start: setup and first compile included
        watchdog = []
        try:
            return _train(config, workdir, model_cls, out, signals, watchdog)
        finally:
            for w in watchdog:
                w.stop()  # peers must not take this client's normal end for a loss


def _train(config, workdir, model_cls, out, signals, watchdog: list) -> dict:
    t = config.train
    run_dir = Workdir(workdir)
    primary = client_id() == 0
    # Another run, or files tfllm did not write, are refused before anything is written;
    # bad input (data, tokenizer, what `preflight` checks) fails before the run writes
    # into its workdir, so a refused run leaves it as it was.
    state = check_workdir(workdir, config)
    has_checkpoint, imported = state.has_checkpoint, state.imported
    if not primary:  # other clients log to their own file
        # logs/ may be a link (tfllm launch's folder): it is the root of this write
        out = files.open_for_writing(run_dir.logs_dir, f"client_{client_id()}.log", "a",
                                     append=True)
    if t.deterministic:
        import tensorflow as tf
        tf.config.experimental.enable_op_determinism()
    # A new run does not read the workdir's tokenizer (a dead run's is not its own): it
    # trains one or takes it from the data_dir cache, and saves it below.
    run = Run(config, model_cls, workdir if has_checkpoint else None, capture_hlo=True)
    signals.reinstall()  # after the mesh: TensorFlow's multi-client start takes SIGTERM
    check_tokenizer(state, run.tokenizer)
    evaluating = preflight(run)  # what would fail after the last step fails before the first
    # One writer per run: after the input is checked (a refused run leaves the workdir as
    # it was), before anything is written or cleared (a second train on a live run is
    # refused here, naming the live process); released on any exit.
    lock = RunLock(workdir, client_id()).acquire()
    watchdog.append(_Releaser(lock))
    if primary:  # the marker first (a dead run's outputs cleared), then the run's files
        start_run(state, config)
    if primary and not has_checkpoint:
        save_to_run(run.tokenizer, config, workdir)
    checkpointer = run_dir.checkpointer(run.parallel, config.checkpoint)
    if num_clients() > 1 and t.peer_timeout_s > 0:  # from here a lost peer is reported
        watchdog.append(PeerWatchdog(workdir, client_id(), num_clients(), t.peer_timeout_s,
                                     checkpointer.latest_step).start())

    start_step, first_step_s = 0, None
    with _peer_lost_as_one_line(0, checkpointer):  # a restore's collectives too
        if imported:  # pretrained weights: a new run starts from them at step 0
            meta = run_dir.restore_weights(run.model, step=0, fp8_state=False,
                                           checkpointer=checkpointer, new_adapters=True)
            progress_note = ("; fine-tuning from "
                             f"{meta['imported'].get('preset', 'imported weights')}")
            meta = None
        else:
            progress_note = ""
            meta = checkpointer.restore_latest(run.state_variables(),
                                               client_files=run.feed.restore_state)
    if meta is not None:
        start_step = int(meta["step"])
        if primary:
            run_dir.truncate_metrics(start_step)
    if primary:  # after the checkpoint was read: a refused one leaves config.yaml as it was
        run_dir.save_config(config)

    tokens_per_step = t.global_batch_size * config.data.sequence_length
    fpt = flops_per_token(config.model, config.data.sequence_length, config.lora)
    progress = Progress(t.steps, t.progress if primary else "lines", out,
                        mesh_peak(run.parallel, config.precision.policy,
                                  config.precision.tf32), fpt)
    outputs = _Outputs(run_dir, primary, progress)
    mesh = ", ".join(f"{k}={v}" for k, v in run.parallel.shape.items())
    progress.message(f"tfllm: {config.model.family} on mesh [{mesh}] "
                     f"({run.parallel.device_type}), jit_compile={run.jit_compile}, "
                     f"{describe(config.precision)}"
                     + (f"; resuming after step {start_step}" if start_step else "")
                     + progress_note)
    if lock.previous:  # a run that died without ending: its lock went with it
        p = lock.previous
        progress.message(f"tfllm: note: {lock.holder} was left by pid {p.get('pid')} on "
                         f"{p.get('host')} (started {p.get('started')}), which is gone; "
                         "this run holds it now")
    if config.lora.rank:
        progress.message(lora_summary(run.model, config.lora))
    feed = run.feed
    idle = feed.idle_batch_axes()
    if idle:
        progress.message(f"tfllm: note: the batch is sharded over '{feed.batch_axis}' only; "
                         f"the devices along {', '.join(repr(a) for a in idle)} repeat the "
                         "same activations: the custom mesh.rules map neither "
                         "'activation_batch' nor 'activation_length' to them.")
    if not evaluating:
        progress.message("tfllm: no validation data "
                         f"({no_validation_reason(config.data)}): no evaluation")
    if feed.sequence_axis:
        progress.message(f"tfllm: batch rows over '{feed.batch_axis}', sequence over "
                         f"'{feed.sequence_axis}' (attention gathers keys and values over "
                         f"'{feed.sequence_axis}')")

    last, recent = {}, deque(maxlen=t.loss_spike_window)
    throughput, first_step_s = Throughput(), None
    # Step metrics stay on the devices until a step needs them on the host (a logged,
    # evaluated or saved step, a stop, the spike guard): fetching them after every step
    # made the host wait for each step before preparing the next batch.
    pending, shown = [], {}
    from tfllm.config.loader import profile_steps
    from tfllm.train.profile import StepProfiler, profile_dir
    profiler = StepProfiler(profile_steps(t), profile_dir(workdir, client_id()), workdir)
    start = time.perf_counter()
    try:
        for step in range(start_step, t.steps):
            number = step + 1
            limit = float("inf")
            if t.loss_spike_factor > 0 and len(recent) == recent.maxlen:
                limit = t.loss_spike_factor * sum(recent) / len(recent)
            logged = number % t.log_every == 0 or number == t.steps or number == 1
            evaluate_now = (evaluating and t.eval_every and number % t.eval_every == 0
                            and number != t.steps)
            save_now = (config.checkpoint.every and number % config.checkpoint.every == 0
                        and number != t.steps)
            began = time.perf_counter()
            for w in watchdog:
                w.step = number  # the step this client waits in, for the message
            profiler.before(number)
            pending.append((number, _step_or_peer_lost(run, step, limit, checkpointer)))
            # The vote is the first host read after a step: a collective the step lost
            # to a peer fails here, so it is reported as that peer's loss too.
            with _peer_lost_as_one_line(number, checkpointer):
                stop = any_client(signals.requested, number, run.parallel.mesh)
            values = None
            traced = profiler.ends_at(number)
            if (logged or evaluate_now or save_now or stop or first_step_s is None
                    or t.loss_spike_factor > 0 or number == t.steps or traced):
                values = _read_metrics(pending, run, t, recent, checkpointer)
                shown = values
            if traced:  # the metrics were read: the traced steps' device work is done
                profiler.stop()
                progress.message(f"tfllm: profile of steps {t.profile_steps} in "
                                 f"{profiler.logdir} (tensorboard --logdir {profiler.logdir}, "
                                 "Profile tab)")
            now = time.perf_counter()
            if first_step_s is None:  # the first step includes compilation: not timed
                first_step_s = now - start
                if run.step.xla_report is not None:
                    progress.message("tfllm: " + run.step.xla_report.line())
                _report_costs(run, run_dir, primary, progress)
            else:
                throughput.add_step(now - began, tokens_per_step)
            # tokens/s of the steps since the last logged one (pauses excluded)
            tps = throughput.close_interval() if logged else throughput.rate()
            eta = (t.steps - number) * tokens_per_step / tps if tps else 0.0
            record = None
            if logged:
                record = {"step": number, **{k: v for k, v in values.items()
                                             if k != "step_ok"}, "tokens_per_s": tps}
                if progress.has_peak:  # no MFU on CPU (tfllm.train.metrics.NO_CPU_PEAK)
                    record["mfu"] = progress.mfu(tps) or 0.0
            if evaluate_now:
                record = record or {"step": number}
                with _peer_lost_as_one_line(number, checkpointer):
                    record.update(run.evaluate())
            if record is not None:
                outputs.record(record, run.model)
                last = record
            progress.update(number, {**shown, **(record or {})}, tps, eta, logged)
            if stop:
                _save_and_stop(checkpointer, run, config, number,
                               signals.signame or "a signal on another client")
            if save_now:  # its agreement collectives may meet a lost peer too
                with _peer_lost_as_one_line(number, checkpointer):
                    checkpointer.save(number, run.state_variables(),
                                      _meta(config, number, run.tokenizer),
                                      run.feed.state_files)
        # The final checkpoint first, committed before anything after the last step
        # (evaluation, plot, sample) can fail.
        with _peer_lost_as_one_line(t.steps, checkpointer):
            if start_step < t.steps or checkpointer.latest_step() != t.steps:
                checkpointer.save(t.steps, run.state_variables(),
                                  _meta(config, t.steps, run.tokenizer), run.feed.state_files)
            checkpointer.wait()
        if evaluating:
            with _peer_lost_as_one_line(t.steps, checkpointer):
                final = run.evaluate()
            progress.message(f"validation loss {final['eval_loss']:.4f} (perplexity "
                             f"{final['eval_perplexity']:.2f}) after step {t.steps}")
            last = {**last, **final, "step": t.steps}
            outputs.record({"step": t.steps, **final}, None)
    finally:
        profiler.stop()
        outputs.close()
    if primary:
        from tfllm.train.plots import plot_loss
        plot_loss(outputs.metrics_path, run_dir.plot_file)
    if t.sample_tokens and run.tokenizer is not None:
        if config.data.format == "messages":  # a reply through the chat template
            from tfllm.generate.chat import chat_reply
            reply = chat_reply(run, t.sample_prompt, t.sample_tokens, temperature=0.8,
                               top_k=40, seed=0)
            text = f"user: {t.sample_prompt}\nassistant: {reply}"
        else:
            text = sample_text(run, t.sample_prompt, t.sample_tokens, temperature=0.8,
                               top_k=40, seed=0)
        progress.message("sample: " + text)
        last["sample"] = text
    last["first_step_s"] = first_step_s or 0.0
    return last


def _report_costs(run, run_dir: Workdir, primary: bool, progress) -> None:
    """Prints the first step's cost report and writes it to WORKDIR/costs.json; ends the
    HLO dump it was read from (later compilations are not reported)."""
    hlo_dump.stop()
    report = run.step.cost_report
    if report is None:
        return
    for line in report.lines():
        progress.message("tfllm: " + line)
    if primary:
        run_dir.write_costs(report.as_dict())


def _step_or_peer_lost(run, step: int, limit: float, checkpointer) -> dict:
    """One train step, its metrics left on the devices; a collective aborted by a lost
    peer becomes `PeerLost` (one line)."""
    with _peer_lost_as_one_line(step + 1, checkpointer):
        return run.step(run.feed.train_batch(step), loss_limit=limit, fetch=False)


@contextlib.contextmanager
def _peer_lost_as_one_line(number: int, checkpointer):
    import tensorflow as tf
    try:
        yield
    except tf.errors.OpError as e:
        peer = peer_from_error(str(e.message), client_id()) if num_clients() > 1 else None
        if peer is None:
            raise
        raise PeerLost(lost_message(peer, client_id(), number, checkpointer.latest_step(),
                                    "its connection failed in a collective")) from None


def _read_metrics(pending: list, run, t, recent, checkpointer) -> dict:
    """Fetches the metrics of the steps run since the last fetch and returns the newest.

    Each fetched step is checked in order: a non-finite loss (or gradient norm, outside
    float16's loss scaling) with train.on_nonfinite=abort raises `NonFiniteError` naming
    that step. Its update was skipped on the devices, and nothing after it is saved: a
    save always fetches first. Losses of applied steps feed the spike guard's window.
    """
    values = {}
    with _peer_lost_as_one_line(pending[-1][0], checkpointer):
        fetched = [(n, {k: float(to_numpy(v)) for k, v in out.items()}) for n, out in pending]
    pending.clear()
    for number, values in fetched:
        # Under fp16 an overflowing gradient is the loss scale's business: the step is
        # skipped and the scale halved; only a non-finite loss aborts.
        finite = math.isfinite(values["loss"]) and (
            math.isfinite(values["grad_norm"]) or run.loss_scale is not None)
        if not finite and t.on_nonfinite == "abort":
            raise NonFiniteError(
                f"step {number}: loss {values['loss']} / grad_norm "
                f"{values['grad_norm']} is not finite; the update was not applied and "
                "the last good checkpoint stays the latest. Lower "
                "optimizer.learning_rate, or set train.on_nonfinite=skip.")
        if values["step_ok"]:
            recent.append(values["loss"])
    return values


def _save_and_stop(checkpointer, run, config, step: int, signame: str) -> None:
    """Saves after a signal, then raises `Preempted` (exit 75: the signal is why the run
    stops), chained to the save's error when the save failed, so the command can say so."""
    try:
        checkpointer.save(step, run.state_variables(), _meta(config, step, run.tokenizer),
                          run.feed.state_files)
        checkpointer.wait()
    except Exception as e:  # noqa: BLE001  (a full disk, a permission, a failed client)
        raise Preempted(step, signame) from e
    raise Preempted(step, signame)


def _meta(config, step: int, tokenizer) -> dict:
    """A checkpoint's metadata: what defines the run, checked when it resumes."""
    return {"step": step, "config": to_dict(config),
            "tokenizer": tokenizer_fingerprint(tokenizer)}
