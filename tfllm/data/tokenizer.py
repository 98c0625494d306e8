"""Tokenizers: SentencePiece trained offline, UTF-8 bytes, or a user's file/preset.

All share one small interface (`Tokenizer`): `vocab_size`, `eod_id` (the end-of-document
id appended after every document), `encode`, `decode` and `tf_encode`, which tokenizes
a scalar tf.string inside tf.data. The tf side uses keras-hub tokenizers.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from typing import Callable, Iterable, List, Optional

import tensorflow as tf

from tfllm import files
from tfllm.confined import open_regular, read_regular
from tfllm.runpaths import RunPaths
from tfllm.data.errors import DataError
from tfllm.internals import preset_loader, safe_mode

BYTE_VOCAB_SIZE = 257  # 256 byte values + the end-of-document id
MAX_SENTENCES = 50_000  # lines fed to the SentencePiece trainer; bounds training time
NEWLINE_SYMBOLS = ["\n", "\t"]  # SentencePiece trains on lines; keep code layout exact


class Tokenizer:
    """Common tokenizer interface.

    Args:
      vocab_size: number of ids the tokenizer can produce.
      eod_id: the end-of-document id.
      name: short description for logs.
    """

    #: the beginning-of-sequence id, when the tokenizer has one (encode never adds it)
    bos_id: Optional[int] = None

    def __init__(self, vocab_size: int, eod_id: int, name: str):
        self.vocab_size, self.eod_id, self.name = vocab_size, eod_id, name

    @property
    def special_ids(self) -> frozenset:
        """The ids of special tokens (BOS, EOS, ...): what Hugging Face's
        decode(skip_special_tokens=True) leaves out of a text."""
        return frozenset({self.eod_id} | ({self.bos_id} if self.bos_id is not None else set()))

    def encode(self, text: str) -> List[int]:
        """Token ids of `text` (no end-of-document id)."""
        return [int(i) for i in self.tf_encode(tf.constant(text)).numpy()]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """What defines the tokenizer, as '<kind>:<sha256>': checkpoints save it, so a
        resumed run notices a replaced tokenizer even of the same size."""
        raise NotImplementedError

    def traced_encode(self) -> Callable[[tf.Tensor], tf.Tensor]:
        """`tf_encode` traced once per tokenizer, then shared by every tf.data map.

        A batch maps each of its row streams (and each evaluation its own) through the
        tokenizer; tf.data traces every map function anew, and keras-hub's BPE took
        seconds per trace: most of a short fine-tuning run with 8 rows.
        """
        if getattr(self, "_traced_encode", None) is None:
            self._traced_encode = tf.function(
                self.tf_encode, input_signature=[tf.TensorSpec([], tf.string)],
                autograph=False)
        return self._traced_encode

    def tf_encode(self, text: tf.Tensor) -> tf.Tensor:
        """Tokenizes a scalar tf.string into a 1-D int32 tensor (usable in tf.data)."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; id 256 ends a document."""

    def __init__(self):
        super().__init__(BYTE_VOCAB_SIZE, 256, "byte")

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte"

    def tf_encode(self, text: tf.Tensor) -> tf.Tensor:
        return tf.cast(tf.io.decode_raw(text, tf.uint8), tf.int32)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; its `</s>` (eos) id ends a document.

    Args:
      proto: the serialized model (the bytes of a .model file).
      name: description for logs.
    """

    def __init__(self, proto: bytes, name: str = "sentencepiece"):
        import keras_hub
        import sentencepiece as spm

        self.proto = proto
        self._sp = spm.SentencePieceProcessor(model_proto=proto)
        eod = self._sp.eos_id()
        if eod < 0:
            raise DataError(f"{name}: the SentencePiece model has no eos id (</s>) to end "
                            "documents; train it with eos_id >= 0.")
        self._hub = keras_hub.tokenizers.SentencePieceTokenizer(proto=proto)
        super().__init__(self._sp.get_piece_size(), eod, name)
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def special_ids(self) -> frozenset:
        return super().special_ids | {i for i in (self._sp.unk_id(), self._sp.pad_id())
                                      if i >= 0}

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    def fingerprint(self) -> str:
        return "sentencepiece:" + hashlib.sha256(self.proto).hexdigest()

    def tf_encode(self, text: tf.Tensor) -> tf.Tensor:
        return tf.cast(self._hub.tokenize(text), tf.int32)


class KerasHubTokenizer(Tokenizer):
    """A keras-hub tokenizer preset directory (`Tokenizer.from_preset`).

    Args:
      path: the preset directory.
    """

    def __init__(self, path: str):
        self._fingerprint = "keras-hub:" + _sha256_of_folder(path)  # checks every file first
        try:
            self._hub = load_keras_hub_tokenizer(path)
        except DataError as e:  # name the setting, as the other tokenizer errors do
            raise DataError(f"data.tokenizer_path={e}") from None
        eod = getattr(self._hub, "end_token_id", None)
        if eod is None:
            raise DataError(f"data.tokenizer_path={path}: the keras-hub tokenizer defines no "
                            "end_token_id to end documents; use a preset with an end token "
                            "or a SentencePiece .model file.")
        super().__init__(int(self._hub.vocabulary_size()), int(eod), f"keras-hub:{path}")
        bos = getattr(self._hub, "start_token_id", None)
        self.bos_id = int(bos) if bos is not None else None

    @property
    def special_ids(self) -> frozenset:
        return super().special_ids | {int(i) for i in
                                      getattr(self._hub, "special_token_ids", ()) or ()}

    def decode(self, ids: Iterable[int]) -> str:
        # Ids past the tokenizer's vocabulary (a model padded beyond it can emit them)
        # are dropped, as the other tokenizers do: SentencePiece raised IndexError.
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        out = self._hub.detokenize(tf.constant(ids, tf.int32))
        out = out.numpy() if hasattr(out, "numpy") else out
        return out.decode("utf-8", errors="replace") if isinstance(out, bytes) else str(out)

    def tf_encode(self, text: tf.Tensor) -> tf.Tensor:
        return tf.cast(self._hub.tokenize(text), tf.int32)

    def fingerprint(self) -> str:
        return self._fingerprint


def load_keras_hub_tokenizer(path: str, fix: str = "give a keras-hub tokenizer preset "
                             "(tokenizer.save_to_preset) or a SentencePiece .model file"):
    """keras-hub's `Tokenizer.from_preset(path)` in Keras' safe mode.

    A preset's tokenizer.json is deserialized by Keras; safe mode refuses the Python code
    (lambdas) a crafted one could carry, even when this process enabled unsafe
    deserialization for something else (`tfllm.internals.safe_mode`).

    Args:
      path: the preset directory.
      fix: what to do instead, ending the error message.

    Raises:
      DataError (one line) when keras-hub cannot load a tokenizer from `path`.
    """
    try:
        with safe_mode():
            if (os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json"))
                    and os.path.isfile(os.path.join(path, "tokenizer.json"))):
                return _tokenizer_only_preset(path)
            return _tokenizer_class(path).from_preset(path)
    except Exception as e:  # keras-hub raises many kinds for a missing/foreign tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{path}: keras-hub cannot load a tokenizer from it "
                        f"({type(e).__name__}: {first}); {fix}.") from None


def _tokenizer_class(path: str):
    """The keras-hub tokenizer class `Tokenizer.from_preset(path)` should build: of the
    registered tokenizer classes made for the preset's backbone, the first registered
    (keras-hub's built-in one).

    keras-hub 0.32 picks among several such classes (MistralBackbone: MistralTokenizer and
    MistralTekkenTokenizer; LlamaBackbone: LlamaTokenizer and MoonshineTokenizer) in the
    order of a set of classes, which changes from process to process: a Mistral folder
    with a SentencePiece tokenizer.model then loaded as a Tekken tokenizer without a
    vocabulary in some runs. Registration order is the same in every process. (A
    tekken.json still loads as Tekken: keras-hub's Mistral converter checks the file.)
    """
    import keras
    import keras_hub  # lazy: keras-hub only for keras-hub tokenizers

    base = keras_hub.tokenizers.Tokenizer
    backbone = preset_loader(path).check_backbone_class()
    if backbone is None:
        return base
    registered = keras.saving.get_custom_objects().values()  # in registration order
    return next((obj for obj in registered
                 if isinstance(obj, type) and issubclass(obj, base) and obj is not base
                 and getattr(obj, "backbone_cls", None) is backbone), base)


def _tokenizer_only_preset(path: str):
    """What `tokenizer.save_to_preset(path)` wrote (tokenizer.json + assets, no backbone
    config.json, which `Tokenizer.from_preset` needs to find the class): the tokenizer
    deserialized from its own config (in the caller's safe mode), then its assets."""
    import json

    import keras
    import keras_hub  # noqa: F401  (registers keras-hub's tokenizer classes)
    # a downloaded folder's: a regular file of a bounded size (the vocabulary is an asset)
    config = json.loads(read_regular(os.path.join(path, "tokenizer.json"), 16 << 20,
                                     "a keras-hub tokenizer.json"))
    tokenizer = keras.saving.deserialize_keras_object(config)
    if not hasattr(tokenizer, "load_preset_assets"):
        raise ValueError(f"tokenizer.json holds a {type(tokenizer).__name__}, not a keras-hub "
                         "tokenizer")
    tokenizer.load_preset_assets(path)
    return tokenizer


#: the largest tokenizer file read (a SentencePiece model is a few MiB; a Hugging Face
#: tokenizer.json tens of MiB): a bound, so that no link to a device or FIFO, nor a huge
#: file named by data.tokenizer_path, is read until memory runs out or forever
MAX_TOKENIZER_FILE_BYTES = 1 << 30


def _read_model(path: str, what: str) -> bytes:
    """A tokenizer file's bytes: a regular file of at most MAX_TOKENIZER_FILE_BYTES."""
    return read_regular(path, MAX_TOKENIZER_FILE_BYTES, "a tokenizer file", DataError,
                        f"{what} must name a SentencePiece .model file or a keras-hub "
                        "tokenizer preset directory")


def _sha256_of_folder(path: str) -> str:
    """sha256 over a folder's files: each one's relative name and content's sha256. Every
    file must be a regular one of bounded size (read before keras-hub reads any)."""
    digest = hashlib.sha256()
    entries = sorted((os.path.relpath(os.path.join(root, name), path),
                      os.path.join(root, name))
                     for root, _, names in os.walk(path) for name in names)
    for rel, full in entries:
        with open_regular(full, MAX_TOKENIZER_FILE_BYTES, "a tokenizer file", DataError,
                          "data.tokenizer_path must name a keras-hub tokenizer preset "
                          "directory of files") as f:
            content = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 24), b""):
                content.update(chunk)
        digest.update(rel.encode("utf-8") + b"\0" + content.digest())
    return digest.hexdigest()


def train_sentencepiece(texts: Iterable[str], vocab_size: int,
                        max_sentences: int = MAX_SENTENCES) -> bytes:
    """Trains a unigram SentencePiece model on `texts`; returns the serialized model.

    Deterministic: the input lines are an evenly strided sample (no random sampling),
    the trainer runs single-threaded, and nothing is normalized, so code keeps its
    whitespace. Byte fallback (exact round trip of any text) is on when the vocabulary
    has room for the 256 byte pieces (vocab_size >= 1024).

    Args:
      texts: training documents.
      vocab_size: pieces in the model (an upper bound: tiny texts may yield fewer).
      max_sentences: cap on the lines given to the trainer.
    """
    import sentencepiece as spm

    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    if not lines:
        raise DataError("data.tokenizer=sentencepiece: the training data has no text to "
                        "train a tokenizer on; add documents or use data.tokenizer=byte.")
    step = -(-len(lines) // max_sentences)
    lines = lines[::step]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="unigram", normalization_rule_name="identity",
        remove_extra_whitespaces=False, user_defined_symbols=NEWLINE_SYMBOLS,
        allow_whitespace_only_pieces=True, split_digits=True,
        byte_fallback=vocab_size >= 1024, hard_vocab_limit=False,
        input_sentence_size=0, shuffle_input_sentence=False, num_threads=1,
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, minloglevel=2)
    return model.getvalue()


def _write_atomic(root: str, path: str, data: bytes) -> None:
    """`path` inside `root` (the workdir, or the data_dir cache), whole or not at all; the
    temporary name is this process's, as runs may share the cache."""
    files.write_atomically(root, path, data, suffix=f".{os.getpid()}.tmp")


def _check_vocab(tokenizer: Tokenizer, model_vocab: int, what: str) -> Tokenizer:
    if tokenizer.vocab_size > model_vocab:
        raise DataError(f"{what} has {tokenizer.vocab_size} tokens but model.vocab_size is "
                        f"{model_vocab}; set model.vocab_size >= {tokenizer.vocab_size} "
                        "(a larger model vocabulary is fine: the extra ids are unused).")
    return tokenizer


def from_file(path: str) -> Tokenizer:
    """A SentencePiece .model file or a keras-hub tokenizer preset directory."""
    path = os.path.expanduser(path)
    if not path:
        raise DataError("data.tokenizer=file needs data.tokenizer_path: a SentencePiece "
                        ".model file or a keras-hub tokenizer preset directory.")
    if not os.path.exists(path):
        raise DataError(f"data.tokenizer_path={path}: no such file or directory; give an "
                        "existing SentencePiece .model file or keras-hub preset directory.")
    if os.path.isdir(path):
        return KerasHubTokenizer(path)
    proto = _read_model(path, "data.tokenizer_path")
    try:
        return SentencePieceTokenizer(proto, name=path)
    except (RuntimeError, OSError) as e:
        raise DataError(f"data.tokenizer_path={path}: not a SentencePiece model ({e}); "
                        "give a .model file or a keras-hub preset directory.") from None


def run_tokenizer_path(workdir: str) -> str:
    """Where a run keeps its trained SentencePiece model: WORKDIR/tokenizer/tokenizer.model."""
    return RunPaths(workdir).tokenizer_model_file


def save_to_run(tokenizer: Tokenizer, data, workdir: str) -> Optional[str]:
    """Writes a trained SentencePiece tokenizer (data.tokenizer=sentencepiece) into the
    workdir, where `load_tokenizer` finds it when the run resumes; returns the path, or
    None for the other kinds (byte needs no file; file stays at data.tokenizer_path).

    Args:
      tokenizer: the run's tokenizer.
      data: the config's `DataConfig` (its `tokenizer` kind).
      workdir: the run directory.
    """
    if data.tokenizer != "sentencepiece" or not isinstance(tokenizer, SentencePieceTokenizer):
        return None
    path = run_tokenizer_path(workdir)
    _write_atomic(workdir, path, tokenizer.proto)
    return path


def load_tokenizer(data, vocab_size: int, workdir: Optional[str] = None,
                   training_texts: Optional[Callable[[], Iterable[str]]] = None,
                   log: Callable[[str], None] = lambda msg: None) -> Tokenizer:
    """The tokenizer the data settings ask for, checked against the model's vocabulary.

    sentencepiece: reloaded from WORKDIR/tokenizer/tokenizer.model when present, else
    from the data_dir cache keyed by (training-text hash, vocab size), else trained
    on the training documents and written to both.

    Args:
      data: the config's `DataConfig` (tokenizer, tokenizer_path, data_dir, and the
        source the SentencePiece model trains on).
      vocab_size: `model.vocab_size`: the pieces a SentencePiece model is trained with,
        and the most any tokenizer may have.
      workdir: the run directory (None: do not save into a run).
      training_texts: returns the training documents; default: the configured source's
        training split (tfllm.data.sources.iterate_documents).
      log: receives one-line progress messages (e.g. training time).
    """
    if data.tokenizer == "byte":
        return _check_vocab(ByteTokenizer(), vocab_size, "data.tokenizer=byte")
    if data.tokenizer == "file":
        return _check_vocab(from_file(data.tokenizer_path), vocab_size,
                            f"data.tokenizer_path={data.tokenizer_path}")
    run_path = run_tokenizer_path(workdir) if workdir else None
    if run_path and os.path.exists(run_path):
        try:
            tokenizer = SentencePieceTokenizer(_read_model(run_path, run_path), run_path)
        except (RuntimeError, OSError) as e:
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{run_path}: not a readable SentencePiece model ({detail}); put "
                            "the run's own tokenizer back (a resumed run refuses another "
                            "one).") from None
        return _check_vocab(tokenizer, vocab_size, run_path)
    if training_texts is None:
        from tfllm.data.sources import iterate_documents
        training_texts = lambda: iterate_documents(data, "train")  # noqa: E731
    texts = list(training_texts())
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    key = f"unigram-v{vocab_size}-{digest.hexdigest()[:16]}"
    cache = os.path.expanduser(data.data_dir)
    cache_path = os.path.join(cache, "tokenizers", key + ".model")
    if os.path.exists(cache_path):
        proto = _read_model(cache_path, cache_path)
    else:
        start = time.perf_counter()
        proto = train_sentencepiece(texts, vocab_size)
        log(f"trained a {vocab_size}-piece SentencePiece tokenizer in "
            f"{time.perf_counter() - start:.1f}s")
        _write_atomic(cache, cache_path, proto)
    if run_path:
        _write_atomic(workdir, run_path, proto)
    return _check_vocab(SentencePieceTokenizer(proto, run_path or cache_path), vocab_size,
                        "the trained SentencePiece model")
