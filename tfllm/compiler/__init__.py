"""How tfllm compiles, what it compiles for, and what was compiled; one floor above
`tfllm.parallel`.

* `jit`: the one place a step function becomes a compiled `tf.function`: whether XLA is
  used (`resolve_jit`), the mesh context its ops are traced in (`tfllm.parallel.context`),
  XLA clustering on a DTensor mesh (`scope`, strict compilation), and the retry around
  DTensor's loop-name clash (`Retraced`). Train step, evaluation and generation all call
  `compile_fn`; none enters the mesh context itself.
* `reports`: the first call of a compiled step, read (`FirstCall`): what XLA compiled of
  it (`xla`: clusters per device, ops left outside, checked) and what it costs (`costs`:
  every collective per device, from the executed graphs; the FP8 GEMMs of its HLO).
* `hlo_dump`: the HLO modules XLA compiles in this process (`--xla_dump_to`).
* `hlo_stats`: XLA's HLO text, parsed (pure Python): instructions, kernels, collectives;
  `fp8_hlo`: which dots of it multiply FP8 operands (pure Python).
* `targets`: the GPU targets `tfllm plan` compiles for, with their datasheet figures
  (plain data; also the peaks `tfllm train` reports MFU against).

Nothing here imports models, precision, train or plan: they import it.
"""
