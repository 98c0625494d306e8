"""How tfllm compiles, and what it compiles for; one floor above `tfllm.parallel`.

* `jit`: the one place a step function becomes a compiled `tf.function`: whether XLA is
  used (`resolve_jit`), the mesh context its ops are traced in (`tfllm.parallel.context`),
  XLA clustering on a DTensor mesh (`scope`, strict compilation), and the retry around
  DTensor's loop-name clash (`Retraced`). Train step, evaluation and generation all call
  `compile_fn`; none enters the mesh context itself.
* `hlo_stats`: XLA's HLO text, parsed (pure Python): instructions, kernels, collectives.
* `targets`: the GPU targets `tfllm plan` compiles for, with their datasheet figures
  (plain data; also the peaks `tfllm train` reports MFU against).

Nothing here imports models, precision, train or plan: they import it.
"""
