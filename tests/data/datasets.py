"""What the chat and preference data tests share: the shipped examples and the configs
and batches of a run's geometry over them (byte tokens, ChatML)."""

import os

from tfllm.config import Config
from tfllm.data.pipeline import Batches
from tfllm.data.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "tfllm", "data", "chat_example.jsonl")
PAIRS = os.path.join(ROOT, "tfllm", "data", "preference_example.jsonl")
CHATML = os.path.join(ROOT, "tfllm", "data", "templates", "chatml.jinja")


def chat_config(loss_on="assistant", fmt="messages", paths=(EXAMPLE,), length=256, rows=4,
                accum=1, template=CHATML):
    config = Config()
    d = config.data
    d.source, d.format, d.paths, d.tokenizer = "text", fmt, list(paths), "byte"
    d.chat_template, d.sequence_length, d.validation_fraction = template, length, 0.1
    config.model.vocab_size, config.model.max_sequence_length = 257, length
    config.train.loss_on, config.train.global_batch_size = loss_on, rows
    config.train.grad_accum_steps = accum
    return config


def chat_batches(config, split, **kwargs):
    """`Batches` of a `chat_config`, in a run's geometry: all its rows, byte tokens."""
    t = config.train
    return Batches(config.data, ByteTokenizer(), split, micro_batches=t.grad_accum_steps,
                   micro_batch_rows=t.global_batch_size // t.grad_accum_steps,
                   loss_on=t.loss_on, **kwargs)


def pair_config(paths=(PAIRS,), length=192, pairs=4, accum=1):
    config = Config()
    d = config.data
    d.source, d.format, d.paths, d.tokenizer = "text", "preference", list(paths), "byte"
    d.chat_template, d.sequence_length, d.validation_fraction = CHATML, length, 0.1
    config.model.vocab_size, config.model.max_sequence_length = 257, length
    config.train.objective, config.lora.rank = "dpo", 4
    config.train.global_batch_size, config.train.grad_accum_steps = pairs, accum
    return config


def pair_batches(config, split, rows=None, **kwargs):
    """`Batches` in a DPO run's geometry: two rows per pair (`tfllm.data.feed`)."""
    t = config.train
    return Batches(config.data, ByteTokenizer(), split, rows, micro_batches=t.grad_accum_steps,
                   micro_batch_rows=2 * t.global_batch_size // t.grad_accum_steps,
                   loss_on=t.loss_on, **kwargs)
