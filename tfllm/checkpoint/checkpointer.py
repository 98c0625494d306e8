"""`Checkpointer`: sharded, atomic, optionally asynchronous saves and verified restores."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
import warnings
from typing import Callable, Dict, Optional, Union

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfllm.checkpoint import storage
from tfllm.checkpoint.reader import Reader
from tfllm.checkpoint.shards import CheckpointError, owned_blocks, tf_variable
from tfllm.confined import relative_name
from tfllm.files import make_dirs
from tfllm import contracts

log = logging.getLogger("tfllm.checkpoint")

ClientFiles = Union[None, str, Dict[str, bytes], Callable[[], Dict[str, bytes]]]
#: what a restore hands this client's saved files to (the data-iterator state)
FilesConsumer = Optional[Callable[[Dict[str, bytes]], None]]


def _client_info(parallel, client_id, num_clients):
    if parallel is not None:  # DTensor's own view (multi-client: from DTENSOR_* env vars)
        return (dtensor.client_id() if client_id is None else client_id,
                dtensor.num_clients() if num_clients is None else num_clients)
    return (contracts.client_id() if client_id is None else client_id,
            contracts.num_clients() if num_clients is None else num_clients)


def _read_client_files(client_files: ClientFiles) -> Dict[str, bytes]:
    """The caller's per-client files as {relative name: bytes}, read now (at the step)."""
    if client_files is None:
        return {}
    if callable(client_files):
        client_files = client_files()
    if isinstance(client_files, str):
        root, out = client_files, {}
        for folder, _, names in os.walk(root):
            for n in names:
                full = os.path.join(folder, n)
                with open(full, "rb") as f:
                    out[os.path.relpath(full, root)] = f.read()
        client_files = out
    return {relative_name(k, "client_files", CheckpointError): bytes(v)
            for k, v in client_files.items()}


def agree_nonce(mesh, num_clients: int) -> str:
    """A random id that every client gets the same copy of (one tiny all-reduce over the
    mesh; it is also a barrier: no client writes before every client reached the save)."""
    if num_clients == 1 or mesh is None:
        return secrets.token_hex(4)
    dims = list(mesh.dim_names)
    ones = [1] * len(dims)
    components = []
    for device, loc in zip(mesh.local_devices(), mesh.local_device_locations()):
        first = all(v == 0 for v in loc.values())  # only one device in the job contributes
        with tf.device(device):
            components.append(tf.constant(secrets.randbits(31) if first else 0,
                                          tf.int64, shape=ones))
    total = tf.reduce_sum(dtensor.pack(components, dtensor.Layout(dims, mesh)))
    return f"{int(dtensor.unpack(total)[0].numpy()):08x}"


class Checkpointer:
    """Saves and restores a run's variables under `directory` (shared by all clients).

    Args:
      directory: where step_XXXXXXXX checkpoints go; created if missing. Uncommitted
        leftovers of crashed saves are removed (by client 0) on construction.
      parallel: the `tfllm.parallel.Parallel` of the run, or None (single device).
      config: a `CheckpointConfig` (max_to_keep, async_save, on_corruption); None: defaults.
      client_id, num_clients: this client and the client count; default DTensor's
        (`dtensor.client_id()/num_clients()`) with a mesh, else DTENSOR_CLIENT_ID/DTENSOR_JOBS.
      barrier_timeout_s: how long client 0 waits for the others' shards (and they for the
        commit) before failing the save.
    """

    def __init__(self, directory: str, parallel=None, config=None, client_id=None,
                 num_clients=None, barrier_timeout_s: float = 600.0):
        if config is None:
            from tfllm.config.schema import CheckpointConfig
            config = CheckpointConfig()
        self.directory = os.path.abspath(directory)
        self.parallel = parallel
        self.config = config
        self.client_id, self.num_clients = _client_info(parallel, client_id, num_clients)
        self.barrier_timeout_s = barrier_timeout_s
        self.timings: Dict[str, float] = {}
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        make_dirs(self.directory)
        self.removed = storage.cleanup(self.directory) if self.client_id == 0 else []
        for path in self.removed:
            log.warning("removed the uncommitted checkpoint %s (an interrupted save)", path)

    # ---- saving ------------------------------------------------------------------------
    def save(self, step: int, variables: Dict[str, object], metadata: Optional[dict] = None,
             client_files: ClientFiles = None) -> None:
        """Saves `variables` as DIR/step_XXXXXXXX (collective: every client calls it).

        The values are copied to host memory before this returns; with async_save the
        files are written and committed in a background thread (see `wait`).

        Args:
          step: the training step (the checkpoint's name; metadata["step"]).
          variables: {name: variable}, e.g. `run_state_variables(...)`.
          metadata: JSON-serializable run information (config, seeds, ...); client 0's
            copy is saved.
          client_files: this client's extra files: {name: bytes}, a callable returning
            that, or a directory whose files are read now.
        """
        self.wait()  # the previous async save's error surfaces here
        start = time.perf_counter()
        asynchronous = bool(self.config.async_save)
        metadata = dict(metadata or {})
        if metadata.get("step", step) != step:
            raise CheckpointError(f"save: metadata['step'] = {metadata['step']} but step = "
                                  f"{step}; leave 'step' out of the metadata.")
        metadata["step"] = step
        metadata = json.loads(json.dumps(metadata))  # a copy; fails now if not JSON
        snapshot = {}
        for name, var in variables.items():
            v = tf_variable(var, name)
            # A synchronous save reads each variable's shards only when it writes them,
            # so the host never holds more than one variable's shards (an import of a
            # model larger than host memory still saves); an async save must copy now.
            blocks = owned_blocks(v, self.client_id, True, name) if asynchronous else (
                lambda v=v, name=name: owned_blocks(v, self.client_id, False, name))
            snapshot[name] = {"shape": [int(n) for n in v.shape], "dtype": v.dtype.name,
                              "blocks": blocks}
        files = _read_client_files(client_files)
        nonce = agree_nonce(self.parallel.mesh if self.parallel else None, self.num_clients)
        self.timings = {"snapshot_s": time.perf_counter() - start}
        args = (step, nonce, snapshot, files, metadata)
        if asynchronous:
            self._thread = threading.Thread(target=self._write_guarded, args=args,
                                            name=f"tfllm-checkpoint-{step}")
            self._thread.start()
        else:
            self._write(*args)

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # re-raised by wait()
            self._error = e

    def _write(self, step, nonce, snapshot, files, metadata) -> None:
        start = time.perf_counter()
        tmp = os.path.join(self.directory, f"{storage.step_name(step)}.tmp-{nonce}")
        make_dirs(self.directory, tmp)  # a link planted at its name is refused
        try:
            storage.write_client(tmp, self.client_id, snapshot, files)
            if self.client_id == 0:
                storage.commit(self.directory, tmp, step, nonce, self.num_clients, metadata,
                               self.barrier_timeout_s)
                for path in storage.prune(self.directory, self.config.max_to_keep):
                    log.info("deleted old checkpoint %s (max_to_keep=%d)", path,
                             self.config.max_to_keep)
            else:
                storage.wait_committed(self.directory, tmp, step, nonce,
                                       self.barrier_timeout_s)
        except BaseException as e:
            if self.client_id == 0 and os.path.isdir(tmp):
                # the waiting clients learn it at once, and fail as this one does
                storage.mark_failed(tmp, e, contracts.io_failure(e))
            if isinstance(e, OSError):  # full disk, quota, permissions: the command's
                # I/O exit code (tfllm.contracts), which finds this OSError as the cause
                raise CheckpointError(f"saving the checkpoint of step {step} failed: {e}; "
                                      "the committed checkpoints are untouched") from e
            raise
        self.timings["write_s"] = time.perf_counter() - start

    def wait(self) -> None:
        """Waits for a background save; re-raises its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the checkpoint save in the background failed: "
                                  f"{error}") from error

    close = wait

    # ---- restoring ---------------------------------------------------------------------
    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""
        steps = storage.committed(self.directory)
        return steps[-1][0] if steps else None

    def restore(self, variables: Dict[str, object], step: Optional[int] = None,
                strict: bool = True, client_files: FilesConsumer = None) -> dict:
        """Restores `variables` from a committed step (default: the newest); returns its
        metadata.

        Args:
          variables: {name: variable}; with strict=False a subset of the saved ones
            (e.g. the model's weights alone, `state.model_variables`).
          step: a committed step, or None for the newest.
          strict: the checkpoint must hold exactly `variables`.
          client_files: called with this client's saved files ({name: bytes}, verified,
            what `save`'s client_files gave) once the variables are restored.
        """
        metadata, files = self._restore(variables, step, strict)
        if client_files is not None:
            client_files(files)
        return metadata

    def _restore(self, variables, step, strict):
        """(metadata, this client's files) of `step`, whose variables are restored."""
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"{self.directory}: no committed checkpoint.")
        path = os.path.join(self.directory, storage.step_name(step))
        start = time.perf_counter()
        reader = Reader(path)
        metadata = reader.metadata()
        files = reader.client_files(self.client_id)
        reader.restore(variables, strict)
        self.timings["restore_s"] = time.perf_counter() - start
        return metadata, files

    def restore_latest(self, variables: Dict[str, object], strict: bool = True,
                       client_files: FilesConsumer = None) -> Optional[dict]:
        """Restores the newest committed checkpoint; None when there is none.

        With on_corruption="fallback", a checkpoint that fails verification is skipped
        with a warning and the previous committed one is tried (nothing is assigned from
        a corrupt one); with "error" the CheckpointError propagates. `client_files` (as
        in `restore`) gets the files of the checkpoint restored; its errors are not
        verification failures, so they propagate.
        """
        steps = [s for s, _ in storage.committed(self.directory)]
        if not steps:
            return None
        failures = []
        for step in reversed(steps):
            try:
                metadata, files = self._restore(variables, step, strict)
            except CheckpointError as e:
                if self.config.on_corruption != "fallback":
                    raise
                failures.append(str(e))
                message = (f"checkpoint step {step} failed verification, falling back to "
                           f"the previous one: {e}")
                log.warning(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                continue
            if client_files is not None:
                client_files(files)
            return metadata
        raise CheckpointError(f"{self.directory}: every committed checkpoint failed: "
                              + " | ".join(failures))

