"""Standard vs blocked (flash) attention (`model.attention_chunk`) against sequence length.

A small Llama (2 layers, hidden 256, 4 heads of 64, vocab 2048), batch 1: on this CPU,
XLA's compiled temporary memory of the one-device train step (jaxlib's CPU compiler on
the exported HLO) and the measured step time through XLA (`tfllm bench`,
train.jit_compile=true; standard and chunked interleaved, the machine is shared); on the
H100 target, `tfllm plan`'s XLA temporaries and roofline step.

    python benchmarks/long_sequence.py --out benchmarks/results/long_sequence
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from remat import exported_cpu_memory  # benchmarks/ is the script's directory

LENGTHS = (1024, 2048, 4096, 8192)
CHUNK = 512
MODEL = ["model.family=llama", "model.num_layers=2", "model.hidden_dim=256",
         "model.num_query_heads=4", "model.num_key_value_heads=4",
         "model.intermediate_dim=1024", "model.vocab_size=2048",
         "model.max_sequence_length=8192", "train.global_batch_size=1", "mesh.axes=data=1",
         "train.jit_compile=true"]
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def _sets(length: int, chunk: int):
    return sum((["--set", s] for s in MODEL + [f"data.sequence_length={length}",
                                               f"model.attention_chunk={chunk}"]), [])


def _tfllm(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "tfllm.cli.main", *args], capture_output=True,
                       text=True, env=ENV, timeout=3600)
    if r.returncode:
        raise SystemExit(f"tfllm {' '.join(args[:3])} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def temp_gib(length: int, chunk: int) -> float:
    return exported_cpu_memory(*_sets(length, chunk))["temp"] / 2**30


def step_ms(length: int, chunk: int) -> float:
    out = _tfllm("bench", "--steps", "2", "--warmup", "1", *_sets(length, chunk))
    return json.loads(out.strip().splitlines()[-1])["step_ms"]


def h100(length: int, chunk: int) -> dict:
    """XLA's temporaries and the roofline step on the H100 target (`tfllm plan`)."""
    plan = json.loads(_tfllm("plan", "--json", *_sets(length, chunk)))
    return {"temp_gib": plan["memory"]["temp"] / 2**30,
            "step_ms": plan["estimated_step_s"] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/long_sequence")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-only", action="store_true",
                        help="Skip the CPU step timings (the memory figures take minutes, "
                             "the standard 8192-token CPU steps much longer).")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = parser.parse_args()
    import tensorflow as tf
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        row = {"length": length, "temp_gib": {}, "step_ms": {}, "step_ms_all": {},
               "h100": {}}
        for chunk in (0, CHUNK):
            row["temp_gib"][chunk] = temp_gib(length, chunk)
            row["h100"][chunk] = h100(length, chunk)
        times = {0: [], CHUNK: []}
        for _ in range(0 if args.memory_only else args.repeats):
            for chunk in (0, CHUNK):
                times[chunk].append(step_ms(length, chunk))
        for chunk in (0, CHUNK):
            row["step_ms"][chunk] = statistics.median(times[chunk]) if times[chunk] else None
            row["step_ms_all"][chunk] = times[chunk]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "tensorflow": tf.__version__,
              "model": MODEL, "chunk": CHUNK, "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Standard vs blocked attention on this CPU ({result['date']})", "",
             f"Small Llama (2 layers, hidden 256, 4 heads), batch 1, chunk {CHUNK}; XLA "
             f"temporaries of the train step and median step time through XLA "
             f"(`benchmarks/long_sequence.py`, TensorFlow {tf.__version__}).", "",
             "## CPU (this host, XLA)", "",
             "| sequence | temp standard GiB | temp blocked GiB | ratio | step standard ms | "
             "step blocked ms | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t, s = r["temp_gib"], r["step_ms"]
        timed = s[0] is not None and s[CHUNK] is not None
        lines.append(f"| {r['length']} | {t[0]:.3f} | {t[CHUNK]:.3f} | "
                     f"{t[CHUNK] / t[0]:.2f} | "
                     + (f"{s[0]:.0f} | {s[CHUNK]:.0f} | {s[CHUNK] / s[0]:.2f} |" if timed
                        else "not timed | not timed | |"))
    lines += ["", "## H100 target (deviceless `tfllm plan`: XLA temporaries, roofline step)",
              "", "| sequence | temp standard GiB | temp blocked GiB | ratio | est. step "
              "standard ms | est. step blocked ms | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["h100"]
        lines.append(f"| {r['length']} | {h[0]['temp_gib']:.3f} | "
                     f"{h[CHUNK]['temp_gib']:.3f} | "
                     f"{h[CHUNK]['temp_gib'] / h[0]['temp_gib']:.2f} | "
                     f"{h[0]['step_ms']:.2f} | {h[CHUNK]['step_ms']:.2f} | "
                     f"{h[CHUNK]['step_ms'] / h[0]['step_ms']:.2f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
