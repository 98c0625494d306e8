"""Tiny data for the data-pipeline tests: a few text files and a config pointing at them."""

import pytest

from tfllm.config import schema

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon phi chi psi omega").split()


def make_docs(n, seed=0):
    """n short, distinct documents (one per file) with code-like layout."""
    docs = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * (seed + 3)) % len(WORDS)] for j in range(5 + i % 9)]
        docs.append(f"def f{i}(x):\n    return '{' '.join(words)}'\n")
    return docs


def write_docs(directory, docs, prefix="doc"):
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / f"{prefix}{i:03d}.txt").write_text(doc, encoding="utf-8")
    return str(directory / f"{prefix}*.txt")


def text_config(tmp_path, num_docs=24, sequence_length=15, **data):
    """A Config reading num_docs text files, with num_docs // 4 separate eval files."""
    config = schema.Config()
    config.data.source = "text"
    config.data.paths = [write_docs(tmp_path / "train", make_docs(num_docs))]
    config.data.eval_paths = [write_docs(tmp_path / "eval", make_docs(num_docs // 4, 1))]
    config.data.sequence_length = sequence_length
    config.data.shuffle_buffer = 64
    config.data.data_dir = str(tmp_path / "cache")
    config.model.vocab_size = 512
    for key, value in data.items():
        setattr(config.data, key, value)
    return config


@pytest.fixture
def text_cfg(tmp_path):
    return text_config(tmp_path)
