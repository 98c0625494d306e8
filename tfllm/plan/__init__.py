"""Planning GPU runs without a GPU: compile the train step for a GPU target and read
memory, kernels and a roofline estimate from the compiled program (floor 11). `export_step`
writes the one-device step's HLO that `tfllm plan` compiles and `benchmarks/gpu/` runs.

The package imports neither TensorFlow nor jax at import time: `gpu_compile` runs with jax
alone (also on GPU machines without TensorFlow), `planner` with TensorFlow alone, and the
planner runs the compile in a child process so that the two XLA builds never share one.
"""
