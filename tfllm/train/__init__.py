"""Training (floor 10): `Run` (the run's state, set up from a config, plus its device feed),
the guarded train step (`step`: computes only; batches come from `tfllm.data.feed`,
compilation and the report of what was compiled from `tfllm.compiler`), the loop with
checkpoints, preemption and evaluation (`loop`, `evaluate`) and its schedule (`schedule`:
what happens at step n, pure), a profile of chosen steps (`profile`), and what a run
reports (`metrics`, `progress`, `tensorboard`, `plots`)."""
