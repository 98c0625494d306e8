"""Building a client's text pipeline: one row template against a pipeline per row.

`tfllm.data.pipeline.Batches` builds its row streams from one template traced once
(`_rows`); `_build(per_row=True)` traces a stream per row, as every source did before
and TFDS still does. For each number of rows, in a fresh process per run (TensorFlow
caches traces), this times building the training pipeline, its first batch and the 20
batches after it, on a corpus of one-document text files written here with the byte
tokenizer. Runs are interleaved round by round (each size, template then per-row) so
that machine noise hits both alike; prints each run's JSON, then the medians and the
ratio per-row / template, and writes them to benchmarks/results/data_pipeline.json.

Usage: python benchmarks/data_pipeline.py [--rounds 3] [--rows 16 64 128] [--files 400]
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from host_info import cpu_name  # noqa: E402  (benchmarks/host_info.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def _one_run(corpus, rows, mode):
    """In this process: build, first batch, 20 more (seconds), as JSON on stdout."""
    import time

    from tfllm.config import load_config
    from tfllm.data.pipeline import Batches
    from tfllm.data.tokenizer import ByteTokenizer

    cfg = load_config(None, ["data.source=text", f'data.paths=["{corpus}/*.txt"]',
                             "data.tokenizer=byte", "model.vocab_size=260",
                             "data.validation_fraction=0.2", "data.sequence_length=16",
                             f"train.global_batch_size={rows}"])
    start = time.perf_counter()
    batches = Batches(cfg.data, ByteTokenizer(), "train", micro_batches=1,
                      micro_batch_rows=rows)
    if mode == "per_row":
        batches.dataset = batches._build(per_row=True)
        batches._iterator = iter(batches.dataset)
    built = time.perf_counter()
    first = next(batches)
    first_at = time.perf_counter()
    for _ in range(20):
        next(batches)
    done = time.perf_counter()
    assert first["tokens"].shape == (1, rows, 17)
    print(json.dumps({"rows": rows, "mode": mode, "build_s": built - start,
                      "first_batch_s": first_at - built, "next_20_s": done - first_at}))




def _write_corpus(folder, files):
    for i in range(files):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(150 + i % 100)]
        with open(os.path.join(folder, f"doc{i:04d}.txt"), "w", encoding="utf-8") as f:
            f.write(" ".join(words) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--one", nargs=3, metavar=("CORPUS", "ROWS", "MODE"),
                        help=argparse.SUPPRESS)  # a single run, in the child process
    args = parser.parse_args()
    if args.one:
        _one_run(args.one[0], int(args.one[1]), args.one[2])
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    runs = {}
    with tempfile.TemporaryDirectory() as corpus:
        _write_corpus(corpus, args.files)
        for _ in range(args.rounds):
            for rows in args.rows:
                for mode in ("template", "per_row"):
                    out = subprocess.run(
                        [sys.executable, os.path.abspath(__file__), "--one", corpus,
                         str(rows), mode], cwd=ROOT, env=env, capture_output=True,
                        text=True, check=True)
                    run = json.loads(out.stdout.strip().splitlines()[-1])
                    print(json.dumps(run), flush=True)
                    runs.setdefault((rows, mode), []).append(run)
    table = []
    for rows in args.rows:
        med = {mode: {key: statistics.median(r[key] for r in runs[(rows, mode)])
                      for key in ("build_s", "first_batch_s", "next_20_s")}
               for mode in ("template", "per_row")}
        to_first = {mode: med[mode]["build_s"] + med[mode]["first_batch_s"] for mode in med}
        table.append({"rows": rows, "template": med["template"], "per_row": med["per_row"],
                      "to_first_batch_ratio_per_row_over_template":
                          to_first["per_row"] / to_first["template"]})
    import tensorflow as tf
    result = {"benchmark": "benchmarks/data_pipeline.py",
              "date": datetime.date.today().isoformat(), "rounds": args.rounds,
              "files": args.files, "cpu": cpu_name(),
              "cores": os.cpu_count(), "python": platform.python_version(),
              "tensorflow": tf.__version__, "medians": table}
    for row in table:
        print(f"{row['rows']:4d} rows: template build {row['template']['build_s']:.2f} s, "
              f"first batch {row['template']['first_batch_s']:.2f} s; per row build "
              f"{row['per_row']['build_s']:.2f} s, first batch "
              f"{row['per_row']['first_batch_s']:.2f} s; to the first batch per row / "
              f"template = {row['to_first_batch_ratio_per_row_over_template']:.1f}x")
    path = os.path.join(HERE, "results", "data_pipeline.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
