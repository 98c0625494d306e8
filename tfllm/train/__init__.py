"""Training (floor 7): `Run` (the run's state, set up from a config, plus its device feed),
the guarded train step (`step`: computes only; batches come from `tfllm.data.feed`,
compilation from `tfllm.compiler.jit`), the loop with checkpoints, preemption and
evaluation (`loop`, `evaluate`), what the executed step costs (`xla`, `costs`,
`hlo_dump`, `profile`), and what a run reports (`metrics`, `progress`, `tensorboard`,
`plots`)."""
