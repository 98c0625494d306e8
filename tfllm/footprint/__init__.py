"""What one device holds, and whether a run's step fits its GPUs, from shapes alone (floor 9).

`layout`: the per-device config of a mesh, the state's bytes in its layout, the weights
that move together and their gather buffers, the float32 gradients a device keeps.
`fit`: the memory-fit estimate (state, gradients, block buffers, activations, workspace)
and the `--set` that fits, which `tfllm train` and `run_training` check before a GPU run
starts (`tfllm.train.preflight`), `tfllm doctor --config` reports, and `tfllm plan` prints
beside its compile. Seconds, no compile: the models are built without memory.
"""
