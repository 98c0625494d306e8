"""Agreement between the clients of a multi-client job, over TensorFlow's coordination
service (the key-value store and barriers that DTensor's multi-client runtime starts).

Single-client runs need no agreement: every function here is then a local no-op. A
worker also answers `tfllm launch`'s readiness handshake here (`announce_ready`, whose
names are `tfllm.contracts`').
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Mapping

from tfllm import files, internals
from tfllm.contracts import READY_FILE_ENV, READY_KEY_ENV, READY_LINE, client_id, num_clients

_TIMEOUT_MS = 10 * 60 * 1000  # a client slower than this is treated as gone


class ClientMismatchError(RuntimeError):
    """The clients of one job were started with different settings."""


def config_digest(config_dict: dict) -> str:
    return hashlib.sha256(json.dumps(config_dict, sort_keys=True).encode()).hexdigest()[:16]


def check_same_config(config_dict: dict) -> None:
    """Raises `ClientMismatchError` unless every client has client 0's config.

    Args:
      config_dict: this client's resolved config as a dict.
    """
    if num_clients() == 1:
        return
    ctx = internals.eager_context()
    mine = json.dumps(config_dict, sort_keys=True)
    ctx.set_config_key_value(f"tfllm/config/{client_id()}", mine)
    theirs = ctx.get_config_key_value("tfllm/config/0")
    if theirs != mine:
        other = json.loads(theirs)
        diffs = [f"{section}.{key}: client 0 has {other[section][key]!r}, client "
                 f"{client_id()} has {config_dict[section][key]!r}"
                 for section in config_dict for key in config_dict[section]
                 if other.get(section, {}).get(key) != config_dict[section][key]]
        raise ClientMismatchError(
            "clients were started with different configs (" + "; ".join(diffs[:5]) + "); "
            "start every worker with the same --config and --set arguments.")


def check_same_devices(device_type: str, local_devices: int) -> None:
    """Raises `ClientMismatchError` unless every client has client 0's kind and number of
    devices: a client that fell back to the CPU (its CUDA libraries failed to load) or
    sees fewer GPUs would otherwise build a mesh that hangs at the first collective."""
    if num_clients() == 1:
        return
    ctx = internals.eager_context()
    mine = f"{device_type}:{local_devices}"
    ctx.set_config_key_value(f"tfllm/devices/{client_id()}", mine)
    theirs = ctx.get_config_key_value("tfllm/devices/0")
    if theirs != mine:
        kind, count = theirs.split(":")
        raise ClientMismatchError(
            f"client 0 has {count} {kind} device(s), client {client_id()} has "
            f"{local_devices} {device_type} device(s); run `tfllm doctor` on client "
            f"{client_id()}'s host (and give every worker the same GPUs).")


def any_client(flag: bool, step: int, mesh=None) -> bool:
    """Whether `flag` is set on any client at `step` (a blocking exchange).

    Used for preemption: a signal may reach the clients at different steps, so they
    agree at each step boundary whether anyone wants to stop, and all stop together.

    Args:
      flag: this client's vote.
      step: the step boundary (names the key-value exchange).
      mesh: the run's DTensor mesh: the vote is then one all-reduce (max) of one value
        per device over the mesh, NCCL's on GPUs. Without it, every client writes a key
        and reads every other client's from the coordination service: clients-squared
        requests to one server per step.
    """
    n = num_clients()
    if n == 1:
        return flag
    if mesh is not None:
        return _any_on_mesh(flag, mesh)
    ctx = internals.eager_context()
    ctx.set_config_key_value(f"tfllm/stop/{step}/{client_id()}", "1" if flag else "0")
    votes = [ctx.get_config_key_value(f"tfllm/stop/{step}/{i}") for i in range(n)]
    if step > 2:  # keep the store small; every client has read step - 2 by now
        try:
            ctx.delete_config_key_value(f"tfllm/stop/{step - 2}/{client_id()}")
        except Exception:  # noqa: BLE001  (a missing key is harmless)
            pass
    return "1" in votes


_VOTES = {}


def _any_on_mesh(flag: bool, mesh) -> bool:
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    if mesh not in _VOTES:
        # One value per device: a tensor with a dimension per mesh axis, each split over
        # its axis (DTensor allows one mesh axis per dimension); the max over it is one
        # all-reduce, the same compiled function at every step.
        layout = dtensor.Layout(list(mesh.dim_names), mesh)
        _VOTES[mesh] = (layout, tf.function(tf.reduce_max))
    layout, vote = _VOTES[mesh]
    local = tf.fill([1] * layout.rank, 1.0 if flag else 0.0)
    votes = dtensor.pack([local] * len(mesh.local_devices()), layout)
    return bool(dtensor.unpack(vote(votes))[0].numpy() > 0.5)


def barrier(name: str) -> None:
    """Waits until every client reaches the barrier `name`."""
    if num_clients() > 1:
        internals.eager_context().wait_at_barrier(f"tfllm/{name}", _TIMEOUT_MS)


def announce_ready(environ: Mapping[str, str], out=None) -> None:
    """The worker's side of the readiness handshake (tfllm calls it once its mesh is up):
    creates TFLLM_READY_FILE and prints the TFLLM_READY_KEY line, whichever are set."""
    path = environ.get(READY_FILE_ENV)
    if path:  # in the launcher's log folder, whole or not at all, never through a link
        files.write_atomically(os.path.dirname(os.path.abspath(path)), path,
                               str(environ.get("DTENSOR_CLIENT_ID", "0")))
    key = environ.get(READY_KEY_ENV)
    if key:
        # The process's real stdout: the launcher reads it even where tfllm sends its
        # progress of clients other than 0 to a log file.
        print(READY_LINE.format(key), file=out or sys.__stdout__, flush=True)
