"""The host and the processes: what a run needs of its machine before any sharding.

Floor 3 (imports only the floors below: the ground floor, `tfllm.runpaths`, `tfllm.files`).
`tfllm.parallel` builds meshes and lays out tensors on what this floor has set up:

* `devices`: which devices a run uses (`device_type`), the GPU gate every GPU run passes
  first (`check_gpus`), the NCCL choice, the host's CPU split into logical devices, and
  DTensor's accelerator start-up (`start_devices`);
* `gpu_checks`: the host's GPU facts and the pure checks of them (`tfllm doctor`);
* `environment`: the process settings TensorFlow and XLA read once (GPU memory reserve,
  the persistent XLA compile cache);
* `coordination`: agreement between the clients of a multi-client job and the launcher's
  readiness handshake;
* `watchdog`: heartbeats, and one line instead of a hang when a peer is lost.

Nothing here imports TensorFlow at import time.
"""
