"""Preference pairs (data.format=preference): records, implicit prompts, length rules,
the rows of a batch. Token ids against TRL's own preprocessing: tests/train/test_dpo_trl.py.
"""

import json

import numpy as np
import pytest

from tests.data.datasets import CHATML, PAIRS as EXAMPLE, pair_batches, pair_config
from tfllm.config import ConfigError
from tfllm.config.loader import check_objective
from tfllm.data import DataError
from tfllm.data.chat import read_records
from tfllm.data.chat_template import ChatTemplate
from tfllm.data.preference import PairEncoder, PairStream, parse_line
from tfllm.data.samples import prepare_samples
from tfllm.data.tokenizer import ByteTokenizer

def completion(tokens, mask):
    return bytes(np.asarray(tokens)[np.asarray(mask) == 1].tolist()).decode()


@pytest.mark.parametrize("line,says", [
    ('{"prompt": "a", "chosen": "b"', "not JSON"),
    ('{"prompt": "a", "chosen": "b"}', '"rejected" is missing'),
    ('{"prompt": "a", "chosen": "b", "rejected": 3}', '"rejected" is a int'),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "robot", '
     '"content": "x"}], "rejected": [{"role": "assistant", "content": "y"}]}', "chosen[0].role"),
    ('{"prompt": [], "chosen": [{"role": "assistant", "content": "x"}], "rejected": '
     '[{"role": "assistant", "content": "y"}]}', '"prompt" is not a non-empty list'),
    ('{"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", '
     '"content": "q"}]}', "do not differ after their common messages"),
    ('{"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", '
     '"content": "r"}]}', "share no first message"),
    ('{"prompt": "a", "chosen": "b", "rejected": "c", "tools": "rm -rf /"}', '"tools"'),
    ('{"prompt": "a", "chosen": "b", "rejected": NaN}', "not usable JSON"),
])
def test_a_broken_pair_is_one_error_naming_file_and_line(tmp_path, line, says):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        read_records([str(path)], "preference", parse_line)
    message = str(e.value)
    assert message.startswith(f"{path}:2: ") and says in message and "\n" not in message


def test_implicit_prompts_are_trls():
    """trl.extract_prompt: the common messages; of strings the common characters, less
    a space before the difference."""
    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    whole = parse_line(json.dumps({
        "chosen": [turn("user", "q"), turn("assistant", "yes")],
        "rejected": [turn("user", "q"), turn("assistant", "no")]}), "f:1")
    assert whole.prompt == [turn("user", "q")] and whole.conversational
    assert whole.chosen == [turn("assistant", "yes")]
    text = parse_line('{"chosen": "The sky is blue.", "rejected": "The sky is green."}', "f:1")
    assert (text.prompt, text.chosen, text.rejected) == ("The sky is", " blue.", " green.")


def test_the_example_set_trains_each_completion_and_its_end_of_turn():
    records = read_records([EXAMPLE], "preference", parse_line)
    assert len(records) == 32 and all(r.conversational for r in records)
    encoder = PairEncoder(ByteTokenizer(), ChatTemplate(open(CHATML).read()))
    for record in records:
        pair = encoder(record)
        assert completion(pair.chosen, pair.chosen_mask) == (
            record.chosen[0]["content"] + "<|im_end|>\n")
        assert completion(pair.rejected, pair.rejected_mask) == (
            record.rejected[0]["content"] + "<|im_end|>\n")
        prompt = (~pair.chosen_mask.astype(bool)).sum()
        assert np.array_equal(pair.chosen[:prompt], pair.rejected[:prompt])
        assert bytes(pair.chosen[:prompt].tolist()).decode().endswith(
            "<|im_start|>assistant\n")  # the generation prompt


def test_strings_end_with_the_end_of_document_and_long_pairs_are_cut_or_dropped():
    record = parse_line('{"prompt": "Q: 2+2?\\nA:", "chosen": " 4", "rejected": " 5"}', "f:1")
    tokenizer = ByteTokenizer()
    pair = PairEncoder(tokenizer)(record)
    assert pair.chosen.tolist() == list(b"Q: 2+2?\nA: 4") + [tokenizer.eod_id]
    assert completion(pair.chosen[:-1], pair.chosen_mask[:-1]) == " 4"
    assert pair.chosen_mask[-1] == 1  # the end of document is trained with the reply
    cut = PairEncoder(tokenizer, max_tokens=12)(record)  # keep_start: the first 12 tokens
    assert cut.chosen.tolist() == list(b"Q: 2+2?\nA: 4") and cut.chosen_mask.sum() == 2
    encoder = PairEncoder(tokenizer, max_tokens=10)  # the prompt alone fills 10: dropped
    assert encoder(record) is None and encoder.dropped == ["f:1"]
    empty = parse_line('{"prompt": "a", "chosen": "", "rejected": "b"}', "f:7")
    assert PairEncoder(tokenizer)(empty) is not None  # the end of document is a completion


def test_rows_hold_whole_pairs_side_by_side():
    config = pair_config(pairs=4, accum=2)
    batch = next(pair_batches(config, "train"))
    assert batch["tokens"].shape == (2, 4, 193)
    for a in range(2):
        for p in range(2):
            c, r = batch["tokens"][a, 2 * p], batch["tokens"][a, 2 * p + 1]
            mc, mr = batch["loss_mask"][a, 2 * p], batch["loss_mask"][a, 2 * p + 1]
            start = int(np.argmax(mc))
            assert start == int(np.argmax(mr)) and np.array_equal(c[:start], r[:start])
            assert completion(c, mc).endswith("<|im_end|>\n")
            segments = batch["segment_ids"][a, 2 * p]
            assert (segments[:len(np.trim_zeros(segments, "b"))] == 1).all()
    # a client holding rows 2 and 3 reads exactly those rows of the whole batch
    part = next(pair_batches(config, "train", rows=[2, 3]))
    assert all(np.array_equal(part[k], batch[k][:, 2:4]) for k in batch)
    with pytest.raises(DataError, match="split a pair"):
        pair_batches(config, "train", rows=[1, 2])


def test_the_position_restores_exactly_and_validation_reads_once(tmp_path):
    config = pair_config(pairs=2)
    first = pair_batches(config, "train")
    for _ in range(5):
        next(first)
    first.save_state(str(tmp_path / "it"))
    expected = [next(first) for _ in range(40)]  # several epochs of every stream
    again = pair_batches(config, "train")
    again.restore_state(str(tmp_path / "it"))
    for want in expected:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    pairs = prepare_samples(config.data, ByteTokenizer(), "validation", "all")
    validation = list(pair_batches(config, "validation"))
    assert len(validation) == -(-len(pairs) // 2)  # two pair streams, in order, once
    assert int(sum(b["segment_ids"].astype(bool).any(-1).sum() for b in validation)) == \
        2 * len(pairs)
    stream = PairStream(pairs, seed=3)
    epoch0 = [next(stream).where for _ in pairs]
    assert sorted(epoch0) == sorted(p.where for p in pairs)
    assert [next(stream).where for _ in pairs] != epoch0  # reshuffled each epoch


@pytest.mark.parametrize("setting,says", [
    (dict(objective="sft"), "set both train.objective=dpo and data.format=preference"),
    (dict(rank=0, policy="fp8"), "would use its first FP8 scales"),
    (dict(loss="hinge", label_smoothing=0.1), "applies to dpo.loss=sigmoid only"),
    (dict(loss="orpo", label_smoothing=0.0, rpo_alpha=0.5), "ORPO has its own NLL term"),
])
def test_objective_settings_go_together(setting, says):
    config = pair_config()
    if "objective" in setting:
        config.train.objective = setting["objective"]
    if "rank" in setting:
        config.lora.rank, config.precision.policy = setting["rank"], setting["policy"]
    if "loss" in setting:
        config.dpo.loss, config.dpo.label_smoothing = setting["loss"], setting["label_smoothing"]
        config.dpo.rpo_alpha = setting.get("rpo_alpha", 0.0)
    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("+", r"\+")):
        check_objective(config)
    check_objective(pair_config())
    full = pair_config()
    full.lora.rank = 0  # full fine-tuning: a frozen reference copy
    check_objective(full)
