"""Baseline training throughput of keras-hub's GPT2Backbone under `model.fit`.

What it measures
----------------
Wall-clock time per optimizer step of a small GPT-2 built with
`keras_hub.models.GPT2Backbone` (TensorFlow backend) and wrapped in
`keras_hub.models.GPT2CausalLM(preprocessor=None)`, whose LM head is the tied
token embedding (logits = hidden @ token_embedding.embeddings^T).  Config:
4 layers, hidden 256, 4 heads, intermediate 1024, max_sequence_length 256,
vocabulary 8192, dropout 0 -> 5,322,240 parameters.  One step is forward +
sparse-categorical-crossentropy (from logits) + backward + AdamW(lr=1e-4)
update on a batch of 8 x 256 random tokens (targets are the next tokens),
fed from a repeated `tf.data.Dataset`.  No metrics are attached, so the step
is the bare train step.

Timing: a callback records `time.perf_counter()` at every
`on_train_batch_end`; step time is the difference between consecutive
records.  The first `--warmup` steps of each repeat (tracing/XLA compilation
happens in the very first one) are discarded.  Each repeat is one `fit` call;
the reported `step_ms` is the median over repeats of the per-repeat median,
and `tokens_per_s = 8 * 256 / step_s`.  A per-repeat time budget
(`--budget-s`, total across repeats) stops a repeat early so a run stays
within a few minutes on a 2-core CPU.  Prints exactly one JSON line at the end.

Usage: python benchmarks/keras_hub_baseline.py --jit-compile {true,false,auto}
"""
import argparse
import json
import os
import statistics
import time

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH, SEQ, VOCAB = 8, 256, 8192
EXPECTED_PARAMS = 5_322_240


class StepTimer(keras.callbacks.Callback):
    """Records batch-end timestamps; stops the fit once the budget is spent."""

    def __init__(self, warmup, budget_s, min_timed=5):
        super().__init__()
        self.warmup, self.budget_s, self.min_timed = warmup, budget_s, min_timed
        self.stamps = []

    def on_train_begin(self, logs=None):
        self.stamps = [time.perf_counter()]

    def on_train_batch_end(self, batch, logs=None):
        self.stamps.append(time.perf_counter())
        timed = len(self.stamps) - 1 - self.warmup
        if timed >= self.min_timed and self.stamps[-1] - self.stamps[0] > self.budget_s:
            self.model.stop_training = True

    def step_times(self):
        deltas = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return deltas[self.warmup:]


def parse_jit(value):
    value = value.lower()
    if value not in ("true", "false", "auto"):
        raise argparse.ArgumentTypeError("expected true, false or auto")
    return {"true": True, "false": False, "auto": "auto"}[value]


def build_model():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=4, num_heads=4, hidden_dim=256,
        intermediate_dim=1024, dropout=0.0, max_sequence_length=SEQ,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def make_dataset(seed=0):
    tokens = tf.random.stateless_uniform(
        (BATCH, SEQ + 1), seed=(seed, 1), maxval=VOCAB, dtype=tf.int32)
    x = {"token_ids": tokens[:, :-1], "padding_mask": tf.ones((BATCH, SEQ), tf.int32)}
    y = tokens[:, 1:]
    return tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jit-compile", type=parse_jit, default="auto")
    p.add_argument("--steps", type=int, default=30, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=5, help="discarded steps per repeat")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="total wall-clock budget for all repeats (caps steps)")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")

    keras.utils.set_random_seed(0)
    model = build_model()
    params = model.count_params()
    if params != EXPECTED_PARAMS:
        # GPT2 here: tok emb 8192*256 + pos emb 256*256 + 4 * 789,760 per
        # block + final LayerNorm 512; a mismatch means keras-hub changed
        # its architecture (e.g. untied head or extra biases).
        raise AssertionError(f"param count {params:,} != {EXPECTED_PARAMS:,}")
    print(f"params: {params:,}", flush=True)

    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=None,  # CausalLM.compile would add accuracy on "auto"
        jit_compile=args.jit_compile,
    )
    dataset = make_dataset()
    medians = []
    for r in range(args.repeats):
        timer = StepTimer(args.warmup, args.budget_s / args.repeats)
        model.fit(dataset, epochs=1, steps_per_epoch=args.warmup + args.steps,
                  callbacks=[timer], verbose=0, shuffle=False)
        times = timer.step_times()
        med = statistics.median(times)
        medians.append(med)
        print(f"repeat {r}: {len(times)} timed steps, first (incl. trace) "
              f"{(timer.stamps[1] - timer.stamps[0]) * 1e3:.0f} ms, "
              f"median {med * 1e3:.1f} ms", flush=True)

    step_s = statistics.median(medians)
    print(json.dumps({
        "model": "keras_hub.GPT2Backbone",
        "jit_compile": model.jit_compile if args.jit_compile == "auto" else args.jit_compile,
        "params": params,
        "step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(BATCH * SEQ / step_s, 1),
        "tf": tf.__version__,
        "keras": keras.__version__,
        "keras_hub": keras_hub.__version__,
    }))


if __name__ == "__main__":
    main()
