"""Tokenizers: byte, SentencePiece (trained, cached, reloaded), user files; stats."""

import numpy as np
import pytest
import tensorflow as tf

from tests.data.conftest import make_docs, text_config
from tfllm.data import tokenizer as tok
from tfllm.data.errors import DataError
from tfllm.data.pipeline import Batches
from tfllm.data.stats import unigram_cross_entropy, unigram_loss

CODE = "def f(x):\n    return x  # é\n\n\tpass\n"


def test_byte_tokenizer_round_trip_and_tf():
    t = tok.ByteTokenizer()
    assert (t.vocab_size, t.eod_id) == (257, 256)
    ids = t.encode(CODE)
    assert t.decode(ids + [256]) == CODE
    assert t.decode(ids + [257, 1000, -1]) == CODE  # ids past the vocabulary: dropped
    assert t.tf_encode(tf.constant(CODE)).numpy().tolist() == ids


@pytest.fixture(scope="module")
def tiny_proto():
    texts = make_docs(40) + [CODE] * 3
    return texts, tok.train_sentencepiece(texts, 96)


def test_sentencepiece_is_deterministic_and_keeps_layout(tiny_proto):
    texts, proto = tiny_proto
    assert tok.train_sentencepiece(texts, 96) == proto
    t = tok.SentencePieceTokenizer(proto)
    assert t.vocab_size <= 96 and t.eod_id == 1
    text = make_docs(3)[2]
    ids = t.encode(text)
    assert t.decode(ids) == text  # newlines and indentation survive
    assert t.decode(ids + [t.vocab_size, 10**6, -1]) == text  # past the vocabulary: dropped
    assert t.tf_encode(tf.constant(text)).numpy().tolist() == ids


def test_load_tokenizer_trains_once_then_reuses(tmp_path, monkeypatch):
    cfg = text_config(tmp_path)
    cfg.data.tokenizer, cfg.model.vocab_size = "sentencepiece", 96
    vocab = cfg.model.vocab_size
    first = tok.load_tokenizer(cfg.data, vocab, str(tmp_path / "run1"))
    assert (tmp_path / "run1" / "tokenizer" / "tokenizer.model").exists()

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although cached")
    monkeypatch.setattr(tok, "train_sentencepiece", no_training)
    again = tok.load_tokenizer(cfg.data, vocab, str(tmp_path / "run2"))  # from the data_dir cache
    resumed = tok.load_tokenizer(cfg.data, vocab, str(tmp_path / "run1"))  # from the workdir
    assert again.encode(CODE) == first.encode(CODE) == resumed.encode(CODE)
    # The pipeline runs on it, and a trained model beats the unigram baseline's ceiling.
    batches = Batches(cfg.data, first, micro_batches=1, micro_batch_rows=2)
    assert next(batches)["tokens"].max() < 96
    # Iterator state with a tokenizer op inside tf.data restores exactly too.
    batches.save_state(str(tmp_path / "state"))
    want = [next(batches)["tokens"] for _ in range(3)]
    resumed = Batches(cfg.data, again, micro_batches=1, micro_batch_rows=2)
    resumed.restore_state(str(tmp_path / "state"))
    np.testing.assert_array_equal(np.stack(want), np.stack([next(resumed)["tokens"]
                                                            for _ in range(3)]))
    loss = unigram_loss(cfg.data, first)
    assert 0 < loss < np.log(96)


def test_tokenizer_file_and_its_errors(tmp_path, tiny_proto):
    cfg = text_config(tmp_path)
    path = tmp_path / "user.model"
    path.write_bytes(tiny_proto[1])
    cfg.data.tokenizer, cfg.data.tokenizer_path = "file", str(path)
    assert tok.load_tokenizer(cfg.data, cfg.model.vocab_size).vocab_size <= 96
    cfg.model.vocab_size = 50
    with pytest.raises(DataError, match=r"data.tokenizer_path=.*model.vocab_size is 50.*set "
                                        r"model.vocab_size >= "):
        tok.load_tokenizer(cfg.data, cfg.model.vocab_size)
    cfg.data.tokenizer_path = str(tmp_path / "missing.model")
    with pytest.raises(DataError, match="missing.model: no such file"):
        tok.load_tokenizer(cfg.data, cfg.model.vocab_size)
    cfg.data.tokenizer, cfg.model.vocab_size = "byte", 128
    with pytest.raises(DataError, match="data.tokenizer=byte has 257 tokens"):
        tok.load_tokenizer(cfg.data, cfg.model.vocab_size)


def test_a_broken_tokenizer_file_or_folder_is_one_line(tmp_path):
    cfg = text_config(tmp_path)
    run_model = tmp_path / "run" / "tokenizer" / "tokenizer.model"
    run_model.parent.mkdir(parents=True)
    run_model.write_bytes(b"not a sentencepiece model")
    cfg.data.tokenizer = "sentencepiece"
    with pytest.raises(DataError) as e:  # the run's own (WORKDIR) tokenizer
        tok.load_tokenizer(cfg.data, cfg.model.vocab_size, str(tmp_path / "run"))
    assert str(e.value).startswith(f"{run_model}: not a readable SentencePiece model")
    assert "\n" not in str(e.value)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "readme.txt").write_text("not a preset")
    cfg.data.tokenizer, cfg.data.tokenizer_path = "file", str(tmp_path / "folder")
    with pytest.raises(DataError) as e:
        tok.load_tokenizer(cfg.data, cfg.model.vocab_size)
    assert str(e.value).startswith(f"data.tokenizer_path={tmp_path / 'folder'}: keras-hub "
                                   "cannot load a tokenizer")
    assert "\n" not in str(e.value)


def test_unigram_cross_entropy_of_uniform_data():
    uniform = [list(range(8)) * 10]
    assert unigram_cross_entropy(uniform, uniform, 8) == pytest.approx(np.log(8))
    skewed = [[0] * 90 + [1] * 10]
    assert unigram_cross_entropy(skewed, skewed, 2, smoothing=0) == pytest.approx(
        -(0.9 * np.log(0.9) + 0.1 * np.log(0.1)))


def test_keras_hub_preset_directory(tmp_path):
    """tokenizer=file also takes a keras-hub preset (here a 1-layer Gemma with its tokenizer)."""
    import io

    import keras_hub
    import sentencepiece as spm

    model = io.BytesIO()
    lines = [line for doc in make_docs(40) for line in doc.splitlines()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=96,
        hard_vocab_limit=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", minloglevel=2)
    hub = keras_hub.models.GemmaTokenizer(proto=model.getvalue())
    keras_hub.models.GemmaBackbone(
        vocabulary_size=hub.vocabulary_size(), num_layers=1, num_query_heads=1,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=8,
    ).save_to_preset(str(tmp_path / "preset"))
    hub.save_to_preset(str(tmp_path / "preset"))
    t = tok.from_file(str(tmp_path / "preset"))
    assert (t.vocab_size, t.eod_id) == (hub.vocabulary_size(), hub.end_token_id)
    ids = t.tf_encode(tf.constant("def f0(x):")).numpy().tolist()
    assert t.decode(ids) == "def f0(x):"
    # A model whose vocabulary is padded past the tokenizer's can emit ids it does not
    # have: they are dropped (SentencePiece raised IndexError), as by every tokenizer.
    assert t.decode(ids + [t.vocab_size, t.vocab_size + 7, -1]) == "def f0(x):"
    # Every row stream of a batch maps through the same traced function: traced once.
    traced = t.traced_encode()
    assert traced is t.traced_encode()
    assert traced(tf.constant("def f0(x):")).numpy().tolist() == ids
    assert traced.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("kind", ["byte", "sentencepiece", "keras-hub-bpe"])
def test_decoding_an_id_beyond_the_vocabulary_never_crashes(kind, tmp_path):
    # A model's vocabulary may be padded past its tokenizer's (tfllm allows it), so a
    # sampled id can be one the tokenizer does not have: every kind drops it.
    if kind == "byte":
        t = tok.ByteTokenizer()
    elif kind == "sentencepiece":
        t = tok.SentencePieceTokenizer(tok.train_sentencepiece(make_docs(40), 96))
    else:
        from tests.pretrained import transformers_reference as ref
        ref.keras_hub_tokenizer("llama3").save_to_preset(str(tmp_path / "tok"))
        t = tok.KerasHubTokenizer(str(tmp_path / "tok"))
    ids = [int(i) for i in t.encode("hello")]
    assert t.decode(ids + [t.vocab_size, t.vocab_size + 1000, -1]) == t.decode(ids)
