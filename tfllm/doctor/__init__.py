"""`tfllm doctor`: is this host (or every node of a job) ready for a run?

`diagnose` assembles the findings the command prints: the host's GPU, driver, CUDA and
TensorFlow checks (`tfllm.runtime.gpu_checks`, which every GPU run also makes at start),
with a run's config whether its step fits the GPUs' memory (`tfllm.footprint.fit`), and with
`--report-dir` the job's findings over every node (`job`: versions, GPUs, ports, NCCL
settings, XLA's files and a short all-reduce; `findings`, `allreduce`, `nccl_log`,
`xla_files` are its parts). Nothing here imports TensorFlow except the all-reduce's child.
"""
