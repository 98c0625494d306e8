"""data.source=hf: Hugging Face datasets built in tmp_path with `datasets` itself (parquet,
JSON, CSV, arrow, save_to_disk), never the network. Judged against the text source and
the JSONL path on the same texts and rows: the same tokens, the same resume, the same
per-client shards."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from tests.data.conftest import make_docs, text_config
from tests.data.datasets import EXAMPLE, PAIRS, chat_batches, chat_config, pair_batches, pair_config
from tfllm.data import DataError
from tfllm.data import hf
from tfllm.data.pipeline import Batches
from tfllm.data.tokenizer import ByteTokenizer

datasets = pytest.importorskip("datasets")

BYTES = ByteTokenizer()
KEYS = ("tokens", "segment_ids", "loss_mask")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, and `datasets`' arrow cache in this test's folder."""
    import huggingface_hub.constants
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _take(batches, n):
    return [next(batches) for _ in range(n)]


def _equal(want, got):
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _save(rows, tmp_path, kind, name="d"):
    """`rows` (a dict of columns) written by `datasets` as `kind`; returns the data
    settings that name it."""
    ds = datasets.Dataset.from_dict(rows)
    if kind == "disk":
        ds.save_to_disk(str(tmp_path / name))
        return {"hf_dataset": str(tmp_path / name)}
    path = str(tmp_path / f"{name}.{kind}")
    {"parquet": ds.to_parquet, "jsonl": ds.to_json, "csv": ds.to_csv}[kind](path)
    return {"paths": [path]}


def _hf(config, tmp_path, kind, docs, eval_docs=None, **extra):
    """`config`'s data read from `docs` (and `eval_docs`) through data.source=hf."""
    data = dataclasses.replace(config.data, source="hf", paths=[], eval_paths=[], **extra)
    for key, value in _save({"text": docs}, tmp_path, kind).items():
        setattr(data, key, value)
    if eval_docs is not None:
        data.eval_paths = _save({"text": eval_docs}, tmp_path, kind, "eval")["paths"]
    return data


# ---- text: the text source's tokens ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv", "disk"])
def test_documents_pack_into_the_text_source_s_rows(tmp_path, kind):
    """Each row a document: the same texts as one text file each give the same batches,
    token for token, in training (shuffled, two micro-batches) and validation."""
    config = text_config(tmp_path, validation_fraction=0.0)
    data = _hf(config, tmp_path, kind, make_docs(24),
               None if kind == "disk" else make_docs(6, 1))
    kw = dict(micro_batches=2, micro_batch_rows=2)
    _equal(_take(Batches(config.data, BYTES, **kw), 12), _take(Batches(data, BYTES, **kw), 12))
    if kind != "disk":
        _equal(list(Batches(config.data, BYTES, "validation", **kw)),
               list(Batches(data, BYTES, "validation", **kw)))


def test_the_holdout_is_the_text_source_s(tmp_path):
    """Without separate validation data a row is held out by the hash of its text, as a
    text document is; each split's documents are the text source's."""
    config = text_config(tmp_path, num_docs=60, validation_fraction=0.2)
    config.data.eval_paths = []
    data = _hf(config, tmp_path, "parquet", make_docs(60))
    from tfllm.data.sources import iterate_documents
    for split in ("train", "validation"):
        want = sorted(iterate_documents(config.data, split))
        assert want and sorted(iterate_documents(data, split)) == want


def test_streaming_gives_the_batches_of_random_access(tmp_path):
    config = text_config(tmp_path, num_docs=40, validation_fraction=0.1)
    data = _hf(config, tmp_path, "parquet", make_docs(40))
    streamed = dataclasses.replace(data, hf_streaming=True)
    kw = dict(micro_batches=1, micro_batch_rows=3)
    # 25 steps read past the end of the set: the second epoch reopens the stream
    _equal(_take(Batches(data, BYTES, **kw), 25), _take(Batches(streamed, BYTES, **kw), 25))
    _equal(list(Batches(data, BYTES, "validation", **kw)),
           list(Batches(streamed, BYTES, "validation", **kw)))


@pytest.mark.parametrize("streaming", [False, True])
def test_a_resume_reads_on_exactly(tmp_path, streaming):
    """N steps, save, a new pipeline restored: M - N steps equal M straight ones, past the
    end of an epoch."""
    config = text_config(tmp_path, num_docs=40)
    data = _hf(config, tmp_path, "parquet", make_docs(40), hf_streaming=streaming)
    kw = dict(micro_batches=2, micro_batch_rows=2)
    straight = _take(Batches(data, BYTES, **kw), 30)
    first = Batches(data, BYTES, **kw)
    _take(first, 11)
    first.save_state(str(tmp_path / "state" / "client0"))
    hf._LOADED.clear()  # as a new process: the set loaded again
    resumed = Batches(data, BYTES, **kw)
    resumed.restore_state(str(tmp_path / "state" / "client0"))
    _equal(straight[11:], _take(resumed, 19))


@pytest.mark.parametrize("streaming", [False, True])
def test_clients_read_disjoint_shards_that_cover_the_set(tmp_path, streaming):
    """Two clients holding rows {0, 1} and {2, 3}: together the one client's batches, and
    the documents their streams read are disjoint and are all documents."""
    config = text_config(tmp_path, num_docs=40, validation_fraction=0.0)
    docs = make_docs(40)
    data = _hf(config, tmp_path, "parquet", docs, hf_streaming=streaming)
    kw = dict(micro_batches=1, micro_batch_rows=4, max_batches=6)
    whole = _take(Batches(data, BYTES, **kw), 6)
    clients = [_take(Batches(data, BYTES, rows=rows, **kw), 6) for rows in ([0, 1], [2, 3])]
    for step in range(6):
        for key in ("tokens", "segment_ids"):
            joined = np.concatenate([c[step][key] for c in clients], axis=1)
            np.testing.assert_array_equal(joined, whole[step][key])
    from tfllm.data.sources import documents
    read = [[d.decode() for d in documents(data, "train", 4, row).as_numpy_iterator()]
            for row in range(4)]
    client0, client1 = read[0] + read[1], read[2] + read[3]
    assert not set(client0) & set(client1)
    assert sorted(client0 + client1) == sorted(docs)


def test_a_hub_dataset_is_read_from_the_cache_offline(tmp_path, monkeypatch):
    """A hub name that is not cached, offline, is one line naming it and the fix."""
    config = text_config(tmp_path)
    data = dataclasses.replace(config.data, source="hf", paths=[], eval_paths=[],
                               hf_dataset="nobody/no-such-set")
    with pytest.raises(DataError, match=r"data.hf_dataset=nobody/no-such-set: not a folder, "
                                        r"and datasets cannot load it .* download it") as e:
        next(Batches(data, BYTES, micro_batches=1, micro_batch_rows=1))
    assert "\n" not in str(e.value)


def _cache_as_hub_dataset(tmp_path, docs, name):
    """`docs` in `datasets`' own cache (the fixture's HF_DATASETS_CACHE) as the hub
    dataset `name` ("user/set"), as an earlier online `load_dataset(name)` leaves it:
    prepared by the parquet builder, then stored under the hub name's folder
    (`user___set/default/0.0.0/<hash>`, arrow files named after the set), which is where
    datasets' offline cache module looks (datasets 5.2)."""
    import glob
    import shutil
    cache = datasets.config.HF_DATASETS_CACHE
    path = str(tmp_path / "upload.parquet")
    datasets.Dataset.from_dict({"text": docs}).to_parquet(path)
    datasets.load_dataset("parquet", data_files={"train": path}, cache_dir=cache)
    built = [p for p in glob.glob(os.path.join(cache, "parquet", "*", "*", "*"))
             if os.path.isdir(p)]
    assert len(built) == 1
    user, dataset = name.split("/")
    target = os.path.join(cache, f"{user}___{dataset}", "default", "0.0.0",
                          os.path.basename(built[0]))
    shutil.copytree(built[0], target)
    for arrow in glob.glob(os.path.join(target, "parquet-*")):
        os.rename(arrow, arrow.replace("parquet-", f"{dataset}-"))
    with open(os.path.join(target, "dataset_info.json")) as f:
        info = json.load(f)
    info.update(dataset_name=dataset, config_name="default")
    with open(os.path.join(target, "dataset_info.json"), "w") as f:
        json.dump(info, f)


def test_a_cached_hub_dataset_reads_offline_as_its_files_do(tmp_path):
    """data.hf_dataset=user/set, offline, from what an earlier download left in the cache:
    the same batches, token for token, as the set's rows given as a parquet file."""
    config = text_config(tmp_path, validation_fraction=0.0)
    docs = make_docs(24)
    _cache_as_hub_dataset(tmp_path, docs, "someone/tiny-set")
    hub = dataclasses.replace(config.data, source="hf", paths=[], eval_paths=[],
                              hf_dataset="someone/tiny-set")
    files = _hf(config, tmp_path, "parquet", docs)
    kw = dict(micro_batches=2, micro_batch_rows=2)
    _equal(_take(Batches(files, BYTES, **kw), 12), _take(Batches(hub, BYTES, **kw), 12))


# ---- chat and prompt-completion columns: the JSONL path's tokens ------------------------------
def _jsonl_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "disk"])
def test_messages_columns_give_the_jsonl_path_s_tokens(tmp_path, kind):
    config = chat_config(loss_on="assistant")
    config.data.validation_fraction = 0.0
    rows = _jsonl_rows(EXAMPLE)
    columns = {k: [r.get(k) for r in rows] for k in ("messages",)}
    data = dataclasses.replace(config.data, source="hf", paths=[])
    for key, value in _save(columns, tmp_path, kind).items():
        setattr(data, key, value)
    want = _take(chat_batches(config, "train"), 6)
    config.data = data
    _equal(want, _take(chat_batches(config, "train"), 6))


def test_prompt_completion_columns_give_the_jsonl_path_s_tokens(tmp_path):
    rows = [{"prompt": f"Q{i}: {' '.join(make_docs(3, i))}", "completion": f" A{i}."}
            for i in range(12)]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = chat_config(loss_on="completion", fmt="prompt_completion", paths=(str(path),))
    config.data.validation_fraction = 0.0
    want = _take(chat_batches(config, "train"), 6)
    columns = {k: [r[k] for r in rows] for k in ("prompt", "completion")}
    config.data = dataclasses.replace(config.data, source="hf",
                                      **_save(columns, tmp_path, "parquet"))
    _equal(want, _take(chat_batches(config, "train"), 6))


def test_preference_columns_give_the_jsonl_path_s_pairs(tmp_path):
    """TRL's conversational preference layout (prompt, chosen, rejected) as parquet: the
    JSONL path's rows, pair indices included."""
    config = pair_config()
    config.data.validation_fraction = 0.0
    want = _take(pair_batches(config, "train"), 4)
    rows = _jsonl_rows(PAIRS)
    columns = {k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}
    config.data = dataclasses.replace(config.data, source="hf",
                                      **_save(columns, tmp_path, "parquet"))
    _equal(want, _take(pair_batches(config, "train"), 4))


# ---- bad input: one line naming the setting or file and the fix ------------------------------
def _bad(tmp_path, **data):
    config = text_config(tmp_path, validation_fraction=0.0)
    config.data = dataclasses.replace(config.data, **{"source": "hf", "paths": [],
                                                      "eval_paths": [], **data})
    with pytest.raises(DataError) as e:
        next(Batches(config.data, BYTES, micro_batches=1, micro_batch_rows=1))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_input_is_one_line(tmp_path):
    text = _save({"text": make_docs(4), "n": [1, 2, 3, 4]}, tmp_path, "parquet")
    saved = _save({"text": make_docs(4)}, tmp_path, "disk", "saved")
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": make_docs(4)})
                         ).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "notes.txt").write_text("x")
    assert "data.text_key=body: " in _bad(tmp_path, text_key="body", **text) and \
        "has no column 'body' (it has ['text', 'n']); set data.text_key" in \
        _bad(tmp_path, text_key="body", **text)
    assert "column 'n' of" in _bad(tmp_path, text_key="n", **text) and \
        "holds int64, not text" in _bad(tmp_path, text_key="n", **text)
    assert "data.hf_split=test: " in _bad(tmp_path, hf_dataset=str(tmp_path / "dict"),
                                          hf_split="test")
    assert "is no parquet, JSON, CSV or arrow file" in _bad(
        tmp_path, paths=[str(tmp_path / "notes.txt")])
    assert "mixes file types" in _bad(tmp_path, paths=text["paths"] + [
        _save({"text": ["x"]}, tmp_path, "csv", "other")["paths"][0]])
    assert "no such folder" in _bad(tmp_path, hf_dataset=str(tmp_path / "missing"))
    assert "reads data.paths" in _bad(tmp_path)
    assert "data.hf_eval_split=test names a dataset or its split, but data.paths" in _bad(
        tmp_path, hf_eval_split="test", **text)
    # a saved folder holding a link out of it
    os.symlink(tmp_path / "notes.txt", os.path.join(saved["hf_dataset"], "extra.json"))
    assert "outside" in _bad(tmp_path, **saved)


def test_without_datasets_installed_the_line_names_the_extra(tmp_path, monkeypatch):
    settings = _save({"text": make_docs(4)}, tmp_path, "parquet")
    hf._LOADED.clear()
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    assert "pip install 'tfllm[hf-data]'" in _bad(tmp_path, **settings)


def test_a_row_of_the_wrong_shape_names_its_row(tmp_path):
    config = chat_config(loss_on="completion", fmt="prompt_completion")
    config.data = dataclasses.replace(config.data, source="hf", validation_fraction=0.0,
                                      **_save({"prompt": ["a", "b"], "answer": ["c", "d"]},
                                              tmp_path, "parquet"))
    with pytest.raises(DataError, match=r"data.format=prompt_completion: .*d.parquet has no "
                                        r"column 'completion' \(it has \['prompt', "
                                        r"'answer'\]\); rename the column"):
        chat_batches(config, "train")
    config = chat_config(loss_on="assistant")
    rows = {"messages": [[{"role": "user", "content": "a"}],
                         [{"role": "robot", "content": "b"}]]}
    config.data = dataclasses.replace(config.data, source="hf", validation_fraction=0.0,
                                      **_save(rows, tmp_path, "parquet", "robot"))
    with pytest.raises(DataError, match=r"robot.parquet row 1: messages\[0\].role is 'robot', "
                                        "not one of system, user, assistant, tool; each line "
                                        "must be"):
        chat_batches(config, "train")
