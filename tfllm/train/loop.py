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
import os
import sys
import time
from collections import deque
from typing import Optional

from tfllm import files
from tfllm.compiler import hlo_dump
from tfllm.compiler.reports import FirstCall
from tfllm.checkpoint.lock import RunLock
from tfllm.checkpoint.workdir import (Workdir, check_tokenizer, check_workdir, start_run,
                                      tokenizer_fingerprint)
from tfllm.data.chat_template import check_stored_template, store_chat_template
from tfllm.data.tokenizer import save_to_run
from tfllm.models.lora import summary_line as lora_summary
from tfllm.config.loader import profile_steps, to_dict
from tfllm.runtime.coordination import any_client
from tfllm.contracts import client_id, num_clients
from tfllm.parallel.placement import to_numpy
from tfllm.runtime.watchdog import PeerLost, PeerWatchdog, lost_message, peer_from_error
from tfllm.precision import describe
from tfllm.train import reference
from tfllm.train.dpo import reference_summary
from tfllm.train.metrics import Throughput, flops_per_token, mesh_peak
from tfllm.train.preemption import NonFiniteError, Preempted, SignalWatcher
from tfllm.train.preflight import check_memory, no_validation_reason, preflight
from tfllm.train.profile import StepProfiler, profile_dir
from tfllm.train.progress import Progress
from tfllm.train.run import Run, sample_text
from tfllm.train.schedule import Schedule
from tfllm.train.step import metric_value
from tfllm.train.tensorboard import TensorBoard
from tfllm.train.trackers import Trackers, start_trackers

__all__ = ["Run", "train"]


class _Outputs:
    """What client 0 writes: metrics.jsonl, TensorBoard, the progress display, and the
    experiment trackers (tracking.loggers)."""

    def __init__(self, workdir: Workdir, primary: bool, progress: Progress):
        self.primary, self.progress = primary, progress
        self.metrics_path = workdir.metrics_file
        # TensorFlow writes the event files by path: into a folder made here, no link
        self.tensorboard = (TensorBoard(files.make_dirs(workdir.path, workdir.tensorboard_dir))
                            if primary else None)
        # appended to, never through a link planted at the name
        self.file = (files.open_for_writing(workdir.path, self.metrics_path, "a", append=True)
                     if primary else None)
        self.trackers = Trackers()  # none until `_announce` starts them (client 0 only)

    def record(self, record: dict, model) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:  # a write names no path: say which file it was
                if e.filename is not None:
                    raise
                raise OSError(e.errno, e.strerror, self.metrics_path) from None
        if self.tensorboard is not None:
            self.tensorboard.write(record["step"], record, model)
        self.trackers.log(record)

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


def train(config, workdir: str, model_cls=None, out=None, checked=None) -> dict:
    """Trains per `config` in `workdir`, resuming from its latest checkpoint.

    Args:
      config: a validated `tfllm.config.Config`.
      workdir: the run directory (created if missing).
      model_cls: optional `CausalLM` subclass.
      out: where the progress display goes (client 0 only); default: sys.stdout at
        the time of the call (not of the import, so redirections are honoured).
      checked: what `tfllm.checkpoint.workdir.check_workdir(workdir, to_dict(config))`
        found, when the caller checked the workdir already (`tfllm train` does, before it
        makes the XLA cache there, after `preflight.check_memory`); else both are checked
        here, the memory first. Either way, once.

    Returns:
      The last logged metrics (plus eval results and `first_step_s`).

    Raises:
      InputError: a run that cannot fit this host (`preflight.check_memory`: on GPUs
        `tfllm.footprint.fit.FitError`, naming the `--set` that fits), before anything is
        built or written.
      Preempted: after saving, when a signal asked the run to stop.
      NonFiniteError: a NaN/Inf loss or gradient norm under on_nonfinite=abort.
    """
    out = sys.stdout if out is None else out
    workdir = os.path.expanduser(workdir)  # one folder, as the command line spells it
    if checked is None:  # the command made both checks already, this one first
        check_memory(config)
    with SignalWatcher() as signals:  # from the start: setup and first compile included
        watchdog = []
        try:
            return _train(config, workdir, model_cls, out, signals, watchdog, checked)
        finally:
            for w in watchdog:
                w.stop()  # peers must not take this client's normal end for a loss


class _Training:
    """A run being trained: what the loop's parts share (`_prepare` makes it)."""

    def __init__(self, config, workdir: str, run: Run, state, checkpointer, lock,
                 evaluating: bool, out):
        self.config, self.workdir, self.run, self.state = config, workdir, run, state
        self.run_dir, self.primary = Workdir(workdir), client_id() == 0
        self.checkpointer, self.lock, self.evaluating, self.out = (checkpointer, lock,
                                                                  evaluating, out)
        t = config.train
        self.schedule = Schedule(
            t.steps, t.log_every, t.eval_every if evaluating else 0, config.checkpoint.every,
            profile_steps(t), spike_guard=t.loss_spike_factor > 0)
        self.profiler = StepProfiler(profile_dir(workdir, client_id()), workdir)
        self.tokens_per_step = t.global_batch_size * config.data.sequence_length
        #: set by `_restore` and `_announce`
        self.start_step, self.progress_note = 0, ""
        #: DPO's precomputed reference log-probs (dpo.precompute_reference), by `_restore`
        self.stored_reference = None
        self.progress: Optional[Progress] = None
        self.outputs: Optional[_Outputs] = None


class _Tally:
    """What the step loop carries from one step to the next."""

    def __init__(self, window: int):
        self.recent = deque(maxlen=window)  # the spike guard's losses of applied steps
        self.pending = []  # (step number, its metrics still on the devices)
        self.shown, self.last = {}, {}  # the metrics on display; the last record written
        self.throughput, self.first_step_s = Throughput(), None
        self.started = time.perf_counter()


def _train(config, workdir, model_cls, out, signals, watchdog: list, checked) -> dict:
    training = _prepare(config, workdir, model_cls, out, signals, watchdog, checked)
    _restore(training)
    _announce(training)
    with training.outputs.trackers:  # their runs end last: finished, or as the error says
        try:
            tally = _steps(training, signals, watchdog)
            _finish(training, tally)
        finally:
            training.profiler.stop()
            training.outputs.close()
        return _after(training, tally.last, tally.first_step_s)


def _prepare(config, workdir, model_cls, out, signals, watchdog: list,
             checked=None) -> _Training:
    """Checks the workdir and the input, builds the run, takes the run's lock and writes
    the run's first files; starts the peer watchdog."""
    t = config.train
    primary = client_id() == 0
    # Another run, or files tfllm did not write, are refused before anything is written;
    # bad input (data, tokenizer, what `preflight` checks) fails before the run writes
    # into its workdir, so a refused run leaves it as it was.
    state = checked if checked is not None else check_workdir(workdir, to_dict(config))
    run_dir = Workdir(workdir)
    if not primary:  # other clients log to their own file
        # logs/ may be a link (tfllm launch's folder): it is the root of this write
        out = files.open_for_writing(run_dir.logs_dir, run_dir.client_log(client_id()), "a",
                                     append=True)
    if t.deterministic:
        import tensorflow as tf
        tf.config.experimental.enable_op_determinism()
    # A new run does not read the workdir's tokenizer (a dead run's is not its own): it
    # trains one or takes it from the data_dir cache, and saves it below.
    run = Run(config, model_cls, workdir if state.has_checkpoint else None, capture_hlo=True)
    signals.reinstall()  # after the mesh: TensorFlow's multi-client start takes SIGTERM
    check_tokenizer(state, run.tokenizer)
    if state.has_checkpoint and not state.imported:  # resumed: with its own template
        check_stored_template(config.data, workdir)
    evaluating = preflight(run)  # what would fail after the last step fails before the first
    # One writer per run: after the input is checked (a refused run leaves the workdir as
    # it was), before anything is written or cleared (a second train on a live run is
    # refused here, naming the live process); released on any exit.
    lock = RunLock(workdir, client_id()).acquire()
    watchdog.append(_Releaser(lock))
    if primary:  # the marker first (a dead run's outputs cleared), then the run's files
        start_run(state, config.data)
    if primary and not state.has_checkpoint:
        save_to_run(run.tokenizer, config.data, workdir)
    if primary:  # what data.chat_template names, as this run reads it: exports copy this
        store_chat_template(config.data, workdir)
    # one writer per checkpoint folder, however it is reached (a checkpoints/ link): held
    # before the checkpointer removes interrupted saves there
    lock.hold_checkpoints()
    checkpointer = run_dir.checkpointer(run.parallel, config.checkpoint)
    if num_clients() > 1 and t.peer_timeout_s > 0:  # from here a lost peer is reported
        watchdog.append(PeerWatchdog(workdir, client_id(), num_clients(), t.peer_timeout_s,
                                     checkpointer.latest_step).start())
    return _Training(config, workdir, run, state, checkpointer, lock, evaluating, out)


def _restore(training: _Training) -> None:
    """Resumes from the latest committed checkpoint, or starts from imported weights;
    writes the run's config.yaml."""
    run, run_dir, checkpointer = training.run, training.run_dir, training.checkpointer
    meta = None
    with _peer_lost_as_one_line(0, checkpointer):  # a restore's collectives too
        if training.state.imported:  # pretrained weights: a new run starts from them at 0
            imported = run_dir.restore_weights(run.model, step=0, fp8_state=False,
                                               checkpointer=checkpointer, new_adapters=True)
            if run.reference is not None:  # DPO's reference: the imported weights too
                run_dir.restore_weights(run.reference, step=0, fp8_state=False,
                                        checkpointer=checkpointer)
            training.progress_note = ("; fine-tuning from "
                                      f"{imported['imported'].get('preset', 'imported weights')}")
        else:
            meta = checkpointer.restore_latest(run.state_variables(),
                                               client_files=run.feed.restore_state)
    config = training.config
    if config.train.objective == "dpo" and config.dpo.precompute_reference:
        # after the weights (the reference's) and before the first step; a resumed run
        # reads its values back, checked against the pairs it reads now (refused: before
        # anything of the run was rewritten)
        with _peer_lost_as_one_line(0, checkpointer):
            training.stored_reference = reference.prepare(run, training.workdir,
                                                          meta is not None, training.primary)
    if meta is not None:
        training.start_step = int(meta["step"])
        if training.primary:
            run_dir.truncate_metrics(training.start_step)
    if training.primary:  # after the checkpoint was read: a refused one leaves it as it was
        run_dir.save_config(training.config)


def _announce(training: _Training) -> None:
    """Opens the run's outputs and says what is about to train, on which mesh."""
    config, run = training.config, training.run
    progress = Progress(config.train.steps,
                        config.train.progress if training.primary else "lines", training.out,
                        mesh_peak(run.parallel, config.precision.policy,
                                  config.precision.tf32),
                        flops_per_token(config.model, config.data.sequence_length,
                                        config.lora))
    training.progress = progress
    training.outputs = _Outputs(training.run_dir, training.primary, progress)
    mesh = ", ".join(f"{k}={v}" for k, v in run.parallel.shape.items())
    progress.message(f"tfllm: {config.model.family} on mesh [{mesh}] "
                     f"({run.parallel.device_type}), jit_compile={run.jit_compile}, "
                     f"{describe(config.precision)}"
                     + (f"; resuming after step {training.start_step}"
                        if training.start_step else "")
                     + training.progress_note)
    lock = training.lock
    if lock.previous:  # a run that died without ending: its lock went with it
        p = lock.previous
        progress.message(f"tfllm: note: {lock.holder} was left by pid {p.get('pid')} on "
                         f"{p.get('host')} (started {p.get('started')}), which is gone; "
                         "this run holds it now")
    if config.lora.rank:
        progress.message(lora_summary(run.model, config.lora))
    if config.train.objective == "dpo":
        progress.message(reference_summary(run.model, run.reference, config.dpo.loss,
                                           training.stored_reference))
    feed = run.feed
    idle = feed.idle_batch_axes()
    if idle:
        progress.message(f"tfllm: note: the batch is sharded over '{feed.batch_axis}' only; "
                         f"the devices along {', '.join(repr(a) for a in idle)} repeat the "
                         "same activations: the custom mesh.rules map neither "
                         "'activation_batch' nor 'activation_length' to them.")
    if not training.evaluating:
        progress.message("tfllm: no validation data "
                         f"({no_validation_reason(config.data)}): no evaluation")
    if feed.sequence_axis:
        progress.message(f"tfllm: batch rows over '{feed.batch_axis}', sequence over "
                         f"'{feed.sequence_axis}' (attention gathers keys and values over "
                         f"'{feed.sequence_axis}')")
    # last: a tracker that cannot start is one line before step 1 (exit 2)
    training.outputs.trackers = start_trackers(
        config.tracking, to_dict(config), training.workdir, training.start_step > 0,
        progress.message)


def _steps(training: _Training, signals, watchdog: list) -> _Tally:
    """The steps from the resumed one to the last, each doing what the schedule says.

    Step metrics stay on the devices until a step needs them on the host (a logged,
    evaluated or saved step, a stop, the spike guard): fetching them after every step
    made the host wait for each step before preparing the next batch.
    """
    config, run, checkpointer = training.config, training.run, training.checkpointer
    tally = _Tally(config.train.loss_spike_window)
    for step in range(training.start_step, config.train.steps):
        events = training.schedule.at(step + 1)
        number, began = events.number, time.perf_counter()
        for w in watchdog:
            w.step = number  # the step this client waits in, for the message
        if events.trace_starts:
            training.profiler.start()
        # The first step is read once: what XLA compiled of it, what it communicates.
        first = (FirstCall(run.parallel, run.jit_compile) if step == training.start_step
                 else None)
        limit = _loss_limit(config.train, tally.recent)
        tally.pending.append((number, _step_or_peer_lost(run, step, limit, checkpointer,
                                                         first)))
        # The vote is the first host read after a step: a collective the step lost
        # to a peer fails here, so it is reported as that peer's loss too.
        with _peer_lost_as_one_line(number, checkpointer):
            stop = any_client(signals.requested, number, run.parallel.mesh)
        traced = events.trace_ends and training.profiler.active
        if events.read or stop or tally.first_step_s is None or traced:
            tally.shown = _read_metrics(tally.pending, run, config.train, tally.recent,
                                        checkpointer)
        if traced:  # the metrics were read: the traced steps' device work is done
            _end_trace(training)
        _time_step(training, tally, began, first)
        _record(training, tally, events)
        if stop:
            _save_and_stop(checkpointer, run, config, number,
                           signals.signame or "a signal on another client")
        if events.save:  # its agreement collectives may meet a lost peer too
            _save(training, number)
    return tally


def _loss_limit(t, recent) -> float:
    """The spike guard's limit for the next step's loss (inf until its window is full)."""
    if t.loss_spike_factor > 0 and len(recent) == recent.maxlen:
        return t.loss_spike_factor * sum(recent) / len(recent)
    return float("inf")


def _end_trace(training: _Training) -> None:
    training.profiler.stop()
    logdir = training.profiler.logdir
    training.progress.message(f"tfllm: profile of steps {training.config.train.profile_steps}"
                              f" in {logdir} (tensorboard --logdir {logdir}, Profile tab)")


def _time_step(training: _Training, tally: _Tally, began: float, first) -> None:
    """The first step (compilation included) is timed whole and reported once; later
    steps count towards tokens/s."""
    now = time.perf_counter()
    if tally.first_step_s is None:
        tally.first_step_s = now - tally.started
        _report_first_step(training, first)
    else:
        tally.throughput.add_step(now - began, training.tokens_per_step)


def _record(training: _Training, tally: _Tally, events) -> None:
    """The step's record (logged steps; evaluated ones with their validation loss) into
    metrics.jsonl and TensorBoard, and the progress display."""
    t, progress = training.config.train, training.progress
    number = events.number
    # tokens/s of the steps since the last logged one (pauses excluded)
    tps = tally.throughput.close_interval() if events.log else tally.throughput.rate()
    eta = (t.steps - number) * training.tokens_per_step / tps if tps else 0.0
    record = None
    if events.log:
        record = {"step": number, **{k: v for k, v in tally.shown.items()
                                     if k != "step_ok"}, "tokens_per_s": tps}
        if progress.has_peak:  # no MFU on CPU (tfllm.train.metrics.NO_CPU_PEAK)
            record["mfu"] = progress.mfu(tps) or 0.0
    if events.evaluate:
        record = record or {"step": number}
        with _peer_lost_as_one_line(number, training.checkpointer):
            record.update(training.run.evaluate())
    if record is not None:
        training.outputs.record(record, training.run.model)
        tally.last = record
    progress.update(number, {**tally.shown, **(record or {})}, tps, eta, events.log)


def _save(training: _Training, number: int) -> None:
    run, checkpointer = training.run, training.checkpointer
    with _peer_lost_as_one_line(number, checkpointer):
        checkpointer.save(number, run.state_variables(),
                          _meta(training.config, number, run.tokenizer),
                          run.feed.state_files)


def _finish(training: _Training, tally: _Tally) -> None:
    """The final checkpoint first, committed before anything after the last step
    (evaluation, plot, sample) can fail; then the final evaluation."""
    config, run, checkpointer = training.config, training.run, training.checkpointer
    steps = config.train.steps
    with _peer_lost_as_one_line(steps, checkpointer):
        if training.start_step < steps or checkpointer.latest_step() != steps:
            checkpointer.save(steps, run.state_variables(),
                              _meta(config, steps, run.tokenizer), run.feed.state_files)
        checkpointer.wait()
    if training.evaluating:
        with _peer_lost_as_one_line(steps, checkpointer):
            final = run.evaluate()
        detail = (f"perplexity {final['eval_perplexity']:.2f}" if "eval_perplexity" in final
                  else f"reward accuracy {final['eval_rewards/accuracies']:.3f}")  # DPO
        training.progress.message(f"validation loss {final['eval_loss']:.4f} ({detail}) "
                                  f"after step {steps}")
        tally.last = {**tally.last, **final, "step": steps}
        training.outputs.record({"step": steps, **final}, None)


def _after(training: _Training, last: dict, first_step_s: Optional[float]) -> dict:
    """After the loop: loss.png, a generated sample; the last metrics returned."""
    config, run, t = training.config, training.run, training.config.train
    if training.primary:
        from tfllm.train.plots import plot_loss
        plot_loss(training.outputs.metrics_path, training.run_dir.plot_file)
        training.outputs.trackers.artifact(training.run_dir.plot_file)
    if t.sample_tokens and run.tokenizer is not None:
        if config.data.format == "messages":  # a reply through the chat template
            from tfllm.generate.chat import chat_reply
            reply = chat_reply(run, t.sample_prompt, t.sample_tokens, temperature=0.8,
                               top_k=40, seed=0)
            text = f"user: {t.sample_prompt}\nassistant: {reply}"
        else:
            text = sample_text(run, t.sample_prompt, t.sample_tokens, temperature=0.8,
                               top_k=40, seed=0)
        training.progress.message("sample: " + text)
        last["sample"] = text
    last["first_step_s"] = first_step_s or 0.0
    return last


def _report_first_step(training: _Training, first) -> None:
    """Prints what XLA compiled of the first step and what it costs, and writes the cost
    report to WORKDIR/costs.json; ends the HLO dump it was read from (later compilations
    are not reported)."""
    hlo_dump.stop()
    report = first.report if first is not None else None
    if report is None:
        return
    progress = training.progress
    if report.xla is not None:
        progress.message("tfllm: " + report.xla.line())
    for line in report.costs.lines():
        progress.message("tfllm: " + line)
    if training.primary:
        training.outputs.trackers.artifact(training.run_dir.write_costs(report.costs.as_dict()))


def _step_or_peer_lost(run, step: int, limit: float, checkpointer, reader=None) -> dict:
    """One train step, its metrics left on the devices; a collective aborted by a lost
    peer becomes `PeerLost` (one line). `reader`: the first step's (`FirstCall`)."""
    with _peer_lost_as_one_line(step + 1, checkpointer):
        return run.step(run.feed.train_batch(step), loss_limit=limit, fetch=False,
                        reader=reader)


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
        fetched = [(n, {k: metric_value(to_numpy(v)) for k, v in out.items()})
                   for n, out in pending]
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
