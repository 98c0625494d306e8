"""The first cell of every tfllm notebook: its needs checked, the CPU mesh pinned.

    from tfllm import start_notebook   # this module's `start`
    print(start_notebook(devices=8, needs=["plan"]))

A notebook teaches the same thing on any machine: a laptop, a Mac without the `plan`
extra, a host with one GPU (where `mesh.device_type=auto` would pick the GPU and refuse
an 8-device mesh). `start` hides the GPUs from TensorFlow and splits the CPU into
logical devices, so every mesh in the notebook is a CPU mesh, makes the host's allocator
one a profile traces (TensorFlow's BFC: `tfllm.runtime.environment.traced_cpu_allocations`),
and turns each unmet need into one line that says what to install or do.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Sequence

#: extra -> the modules it installs that a notebook imports
EXTRAS = {"plan": ("jax", "jaxlib"), "notebooks": ("matplotlib",)}


class NotebookNeeds(RuntimeError):
    """A need of the notebook this machine or kernel does not meet (one line)."""


def start(devices: int = 8, needs: Sequence[str] = (), posix: bool = False) -> str:
    """Checks the notebook's needs, hides GPUs and splits the CPU into `devices`.

    Must run before anything initializes TensorFlow (the first cell).

    Args:
      devices: logical CPU devices the notebook's meshes use.
      needs: extras of setup.py it imports (`plan`, `notebooks`).
      posix: it runs a POSIX shell script (launch/multiworker.sh).

    Returns:
      One line describing the devices.

    Raises:
      NotebookNeeds: with the fix, when a need is not met.
    """
    backend = os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if backend != "tensorflow":
        raise NotebookNeeds(f"KERAS_BACKEND={backend}: tfllm runs on Keras' tensorflow "
                            "backend; unset it and restart the kernel.")
    if posix and os.name != "posix":
        raise NotebookNeeds("this notebook starts workers with a POSIX shell script "
                            "(launch/multiworker.sh): run it on Linux or macOS.")
    for extra in needs:
        missing = [m for m in EXTRAS.get(extra, ()) if importlib.util.find_spec(m) is None]
        if missing:
            raise NotebookNeeds(f"this notebook needs the `{extra}` extra ({', '.join(missing)} "
                                f"missing): pip install -e \".[{extra}]\" from the repository "
                                "root, then restart the kernel.")
    from tfllm.runtime import environment
    # Before the CPU devices are made: a profile's memory peak (notebook 01, section 6)
    # on every CPU, not only where oneDNN's allocator is TensorFlow's default.
    environment.traced_cpu_allocations()
    import tensorflow as tf

    from tfllm.runtime.devices import setup_cpu_devices
    os.environ["TFLLM_DEVICE"] = "cpu"  # NCCL off, as `tfllm launch --device cpu`
    try:
        tf.config.set_visible_devices([], "GPU")  # every mesh here is a CPU mesh
    except RuntimeError:
        pass  # already initialized: the check below says so
    count = setup_cpu_devices(devices)
    if count < devices or tf.config.get_visible_devices("GPU"):
        raise NotebookNeeds(f"TensorFlow was initialized before this cell ({count} CPU "
                            f"devices, {devices} needed): restart the kernel and run the "
                            "notebook from the top.")
    return f"{count} logical CPU devices (GPUs hidden: every mesh in this notebook is a CPU mesh)"
