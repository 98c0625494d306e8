"""Every format a run is exported in, dispatched in one place (`tfllm export --format`)."""

from __future__ import annotations

#: the --format values, in the command's order (its help says what each writes)
FORMATS = ("saved-model", "keras-hub", "hf", "peft")


def export_run(fmt: str, config, workdir: str, out: str, dtype: str = "float32",
               max_shard_size="5GB", merge_lora: bool = False,
               vllm_check: bool = True) -> dict:
    """Writes the run in `workdir` (its latest checkpoint) to the new folder `out` in
    `fmt`, one of `FORMATS`; returns what was written (the command prints it as JSON).

    `dtype` and `max_shard_size` apply to `hf` (`dtype` to `peft` too), `merge_lora` to
    `hf`, `vllm_check` (refuse an adapter vLLM cannot serve) to `peft`.
    """
    if fmt == "hf":
        from tfllm.pretrained.hf_export import export_hf
        return export_hf(config, workdir, out, dtype, max_shard_size, merge_lora)
    if merge_lora:
        raise ValueError(f"merge_lora goes with the hf format, not {fmt}.")
    if fmt == "peft":
        from tfllm.pretrained.hf_export import export_peft
        return export_peft(config, workdir, out, dtype, vllm_check)
    if fmt == "keras-hub":
        from tfllm.pretrained.exporter import export_preset
        return export_preset(config, workdir, out)
    if fmt == "saved-model":
        from tfllm.train.export import export_model
        return export_model(config, workdir, out)
    raise ValueError(f"export format {fmt!r}; use one of {', '.join(FORMATS)}.")
