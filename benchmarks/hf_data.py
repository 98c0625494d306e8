"""Tokens per second into the step: data.source=hf against the text source.

The same documents are written once as text files (one document per file, the text
source) and once as a parquet file (one row each, data.source=hf: read memory-mapped,
and as an IterableDataset with data.hf_streaming). For each source, in a fresh process
per run, this times building a client's training `Batches` (what the device feed puts
on the devices, the same for every source) and its first batch, then the next
`--batches` batches: tokens/s is their tokens (rows x (sequence_length + 1)) over that
time, what the step is fed at most. Runs are interleaved round by round (text, hf, hf
streaming) so that machine noise hits each alike; prints each run's JSON, then the
medians and each source's tokens/s over the text source's, and writes them to
benchmarks/results/hf_data.json (hf_data_sentencepiece.json with that tokenizer). Each
run also checks its first batch against the text source's (`same_as_text`).

Usage: python benchmarks/hf_data.py [--rounds 3] [--docs 4000] [--rows 16]
       [--sequence-length 512] [--batches 200] [--tokenizer byte|sentencepiece]
"""

import argparse
import datetime
import hashlib
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
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa", "lambda", "mu"]
SOURCES = ("text", "hf", "hf_streaming")


def _settings(corpus, source, args):
    common = ["data.validation_fraction=0", f"data.sequence_length={args.sequence_length}",
              f"train.global_batch_size={args.rows}", "model.vocab_size=512",
              f"model.max_sequence_length={args.sequence_length}",
              f"data.tokenizer={args.tokenizer}", f"data.data_dir={corpus}/cache"]
    if source == "text":
        return common + ["data.source=text", f'data.paths=["{corpus}/text/*.txt"]']
    return common + ["data.source=hf", f'data.paths=["{corpus}/docs.parquet"]',
                     f"data.hf_streaming={'true' if source == 'hf_streaming' else 'false'}"]


def _one_run(corpus, source, args):
    """In this process: build and first batch, then `args.batches` more; JSON on stdout."""
    import faulthandler
    import time

    faulthandler.dump_traceback_later(1200, exit=True)  # a hang: its stack, then exit
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(corpus, "hf-cache"))
    from tfllm.config import load_config
    from tfllm.data.pipeline import Batches
    from tfllm.data.tokenizer import load_tokenizer

    cfg = load_config(None, _settings(corpus, source, args))
    tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size, os.path.join(corpus, "tok"))
    start = time.perf_counter()
    batches = Batches(cfg.data, tokenizer, "train", micro_batches=1, micro_batch_rows=args.rows)
    first = next(batches)
    first_at = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    done = time.perf_counter()
    tokens = args.batches * args.rows * (args.sequence_length + 1)
    print(json.dumps({"source": source, "to_first_batch_s": first_at - start,
                      "steady_s": done - first_at, "tokens_per_s": tokens / (done - first_at),
                      "first_batch_sha256": hashlib.sha256(
                          first["tokens"].tobytes()).hexdigest()}))




def _write_corpus(folder, docs):
    """`docs` documents of 150-400 words on a few lines, as text files and as parquet."""
    import datasets

    texts = []
    for i in range(docs):
        words = [WORDS[(i * 7 + j * 5) % len(WORDS)] for j in range(150 + (i * 37) % 250)]
        lines = [" ".join(words[k:k + 20]) for k in range(0, len(words), 20)]
        texts.append(f"# document {i}\n" + "\n".join(lines) + "\n")
    os.makedirs(os.path.join(folder, "text"))
    for i, text in enumerate(texts):
        with open(os.path.join(folder, "text", f"doc{i:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    datasets.Dataset.from_dict({"text": texts}).to_parquet(os.path.join(folder, "docs.parquet"))
    return sum(len(t.encode()) for t in texts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--sequence-length", type=int, default=512)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--tokenizer", default="byte", choices=("byte", "sentencepiece"))
    parser.add_argument("--one", nargs=2, metavar=("CORPUS", "SOURCE"),
                        help=argparse.SUPPRESS)  # a single run, in the child process
    args = parser.parse_args()
    if args.one:
        _one_run(args.one[0], args.one[1], args)
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1")
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k not in ("one", "rounds", "docs")]
    runs = {}
    with tempfile.TemporaryDirectory() as corpus:
        text_bytes = _write_corpus(corpus, args.docs)
        for _ in range(args.rounds):
            for source in SOURCES:
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--one", corpus, source,
                     *passed], cwd=ROOT, env=env, capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{source} run failed:\n{out.stderr[-3000:]}")
                run = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps(run), flush=True)
                runs.setdefault(source, []).append(run)
    reference = runs["text"][0]["first_batch_sha256"]
    medians = {source: {"to_first_batch_s": statistics.median(r["to_first_batch_s"]
                                                              for r in runs[source]),
                        "tokens_per_s": statistics.median(r["tokens_per_s"]
                                                          for r in runs[source]),
                        "same_as_text": all(r["first_batch_sha256"] == reference
                                            for r in runs[source])}
               for source in SOURCES}
    for source in SOURCES:
        medians[source]["tokens_per_s_over_text"] = (medians[source]["tokens_per_s"]
                                                     / medians["text"]["tokens_per_s"])
    import datasets
    import tensorflow as tf
    result = {"benchmark": "benchmarks/hf_data.py",
              "date": datetime.date.today().isoformat(), "rounds": args.rounds,
              "docs": args.docs, "text_bytes": text_bytes, "rows": args.rows,
              "sequence_length": args.sequence_length, "batches": args.batches,
              "tokenizer": args.tokenizer, "cpu": cpu_name(), "cores": os.cpu_count(),
              "python": platform.python_version(), "tensorflow": tf.__version__,
              "datasets": datasets.__version__, "medians": medians}
    for source, m in medians.items():
        print(f"{source:13s} {m['tokens_per_s']:12,.0f} tokens/s "
              f"({m['tokens_per_s_over_text']:.2f}x text), first batch "
              f"{m['to_first_batch_s']:.2f} s, same tokens as text: {m['same_as_text']}")
    suffix = "" if args.tokenizer == "byte" else f"_{args.tokenizer}"
    path = os.path.join(HERE, "results", f"hf_data{suffix}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
