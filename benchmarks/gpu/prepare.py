"""Prepares the train steps a lent GPU times: `python benchmarks/gpu/prepare.py [NAME ...]`.

For each case below, `tfllm export-step` (here, with TensorFlow and the plan extra's jax)
writes the one-device step; this keeps its `step.jax` (gzipped: `step.jax.gz`; a serialized jax.export artefact
that any recent jax runs through public APIs: tfllm.plan.jax_export) and `step.json` in
`benchmarks/gpu/exports/NAME/`, which are small (no weights: they are the step's inputs,
filled at random on the GPU). `benchmarks/gpu/run_all.sh` then times every one of them on
the GPU machine in one command. Cases run one at a time (a 7B export holds a few GB).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPORTS = os.path.join(ROOT, "benchmarks", "gpu", "exports")
STANDARD = "model.attention_chunk=0"  # standard attention (the configs ship blocked, 512)
LLAMA_7B_2L = ["model.num_layers=2", "train.global_batch_size=2", "train.grad_accum_steps=1"]
# name -> (config, settings). Batches are one GPU's share of each config's recipe.
# Listed in the order run_all.sh times them (exports/ORDER): what issue 49 asks of a lease
# first (gpt2-small; llama-7b's layer, blocked as the configs ship it, then standard),
# llama-1b last: on the first H200 (2026-11-30) its steps did not finish in 110 s each.
CASES = {
    "gpt2-small-bf16": ("gpt2-small", ["precision.policy=bfloat16",
                                       "train.global_batch_size=8"]),
    "gpt2-small-fp8": ("gpt2-small", ["precision.policy=fp8", "train.global_batch_size=8"]),
    "llama-7b-2l-bf16-blocked": ("llama-7b", ["precision.policy=bfloat16", *LLAMA_7B_2L]),
    "llama-7b-2l-fp8-blocked": ("llama-7b", ["precision.policy=fp8", *LLAMA_7B_2L]),
    "llama-7b-2l-bf16-standard": ("llama-7b", ["precision.policy=bfloat16", STANDARD,
                                               *LLAMA_7B_2L]),
    "llama-7b-2l-fp8-standard": ("llama-7b", ["precision.policy=fp8", STANDARD,
                                              *LLAMA_7B_2L]),
    "llama-1b-bf16": ("llama-1b", ["precision.policy=bfloat16", "train.global_batch_size=4",
                                   "train.grad_accum_steps=1"]),
    "llama-1b-fp8": ("llama-1b", ["precision.policy=fp8", "train.global_batch_size=4",
                                  "train.grad_accum_steps=1"]),
}


def prepare(name: str) -> str:
    config, settings = CASES[name]
    out = os.path.join(EXPORTS, name)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "tfllm.cli.main", "export-step", "--config",
               os.path.join(ROOT, "configs", f"{config}.yaml"), "--out", tmp]
        for s in settings:
            cmd += ["--set", s]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        if r.returncode or not os.path.exists(os.path.join(tmp, "step.jax")):
            raise SystemExit(f"{name}: export-step failed (the plan extra's jax is needed "
                             f"for step.jax):\n{r.stderr[-3000:]}")
        os.makedirs(out, exist_ok=True)
        shutil.copyfile(os.path.join(tmp, "step.json"), os.path.join(out, "step.json"))
        # compressed (StableHLO text-like bytecode compresses well; the RoPE tables and
        # causal masks that once made most of a 7B layer's bytes are computed in the
        # program since masks.row_positions)
        with open(os.path.join(tmp, "step.jax"), "rb") as f, \
                gzip.open(os.path.join(out, "step.jax.gz"), "wb") as g:
            shutil.copyfileobj(f, g)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"cases (default all): {', '.join(CASES)}")
    args = parser.parse_args()
    with open(os.path.join(EXPORTS, "ORDER"), "w") as f:  # run_all.sh's order
        f.write("".join(f"{name}\n" for name in CASES))
    for name in args.names or CASES:
        if name not in CASES:
            raise SystemExit(f"{name}: no such case; the cases: {', '.join(CASES)}")
        out = prepare(name)
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        print(f"{name}: {size / 2**20:.1f} MiB in {os.path.relpath(out, ROOT)}", flush=True)


if __name__ == "__main__":
    main()
