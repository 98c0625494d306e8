"""Chat SFT data: JSONL readers, the loss mask of train.loss_on, packing, batches."""

import json

import numpy as np
import pytest

from tests.data import chat_templates as T
from tests.data.datasets import CHATML, EXAMPLE, chat_batches, chat_config
from tfllm.data import DataError
from tfllm.data.chat import Record, SampleEncoder, parse_line, read_records
from tfllm.data.chat_template import ChatTemplate
from tfllm.data.packing import PackedStream, best_fit
from tfllm.data.samples import prepare_samples
from tfllm.data.tokenizer import ByteTokenizer

def trained_runs(tokens, mask):
    """The trained text of a byte-tokenized sample, one string per run of trained tokens."""
    runs, current = [], []
    for token, trained in zip(tokens, mask):
        if trained:
            current.append(int(token))
        elif current:
            runs.append(bytes(current).decode())
            current = []
    return runs + ([bytes(current).decode()] if current else [])


def record(messages, tools=None):
    return Record("chat.jsonl:1", json.dumps({"messages": messages}), messages=messages,
                  tools=tools)


# ---- readers ---------------------------------------------------------------------------
@pytest.mark.parametrize("line,fmt,says", [
    ('{"messages": [{"role": "user", "content": "hi"}', "messages", "not JSON"),
    ('["user", "hi"]', "messages", "not an object"),
    ('{"conversation": []}', "messages", '"messages" is missing'),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages", "'robot'"),
    ('{"messages": [{"role": "user", "content": ["hi"]}]}', "messages", "not a string"),
    ('{"messages": [{"role": "user"}]}', "messages", "has no content"),
    ('{"prompt": "a"}', "prompt_completion", '"completion" is missing'),
    ('{"prompt": "a", "completion": 3}', "prompt_completion", "a int, not a string"),
])
def test_a_broken_line_is_one_error_naming_file_and_line(tmp_path, line, fmt, says):
    path = tmp_path / "data.jsonl"
    good = ('{"messages": [{"role": "user", "content": "hi"}]}' if fmt == "messages"
            else '{"prompt": "a", "completion": "b"}')
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(DataError) as e:
        read_records([str(path)], fmt)
    message = str(e.value)
    assert message.startswith(f"{path}:3: ") and says in message and "\n" not in message


def test_example_set_reads_and_a_tool_call_needs_no_content():
    records = read_records([EXAMPLE], "messages")
    assert 30 <= len(records) <= 60
    roles = {m["role"] for r in records for m in r.messages}
    assert roles == {"system", "user", "assistant", "tool"}
    assert any(r.tools for r in records)
    parse_line('{"messages": [{"role": "assistant", "content": null, "tool_calls": '
               '[{"function": {"name": "f", "arguments": {}}}]}]}', "x:1", "messages")


# ---- the loss mask ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama3", "qwen2", "mistral", "gemma3"])
def test_every_assistant_turn_with_its_end_of_turn_is_trained(family):
    """By prefixes (these templates have no generation markers): the trained text is
    exactly each assistant reply as rendered, followed by its end-of-turn text."""
    source, specials = T.FAMILIES[family]
    template = ChatTemplate(source, specials)
    messages = T.PLAIN[1:] if family in ("mistral", "gemma3") else T.PLAIN
    sample = SampleEncoder(ByteTokenizer(), "messages", "assistant", template)(
        record(messages))
    eot = template.end_of_turn()
    assert eot and eot in (specials.get("eos_token", ""), "<|eot_id|>", "<|im_end|>\n",
                           "<end_of_turn>\n")
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = trained_runs(sample.tokens, sample.mask)
    assert len(runs) == len(replies)
    for run, reply in zip(runs, replies):
        assert run.endswith(eot) and reply.strip() in run
        assert len(run) <= len(reply) + len(eot) + 1  # the reply, Mistral's leading space
    last = SampleEncoder(ByteTokenizer(), "messages", "last_assistant", template)(
        record(messages))
    assert trained_runs(last.tokens, last.mask) == runs[-1:]


def test_generation_markers_give_the_spans_and_the_end_of_turn():
    sample = SampleEncoder(ByteTokenizer(), "messages", "assistant",
                           ChatTemplate(open(CHATML).read()))(record(T.PLAIN))
    assert trained_runs(sample.tokens, sample.mask) == ["4.<|im_end|>",
                                                        '6, which is "six".<|im_end|>']
    # markers that leave the end of turn out still train it
    outside = open(CHATML).read().replace("{{- '<|im_end|>' }}\n        {%- endgeneration %}",
                                          "{%- endgeneration %}{{- '<|im_end|>' }}")
    assert outside != open(CHATML).read()
    sample = SampleEncoder(ByteTokenizer(), "messages", "assistant",
                           ChatTemplate(outside))(record(T.PLAIN))
    assert trained_runs(sample.tokens, sample.mask) == ["4.<|im_end|>\n",
                                                        '6, which is "six".<|im_end|>\n']


def test_mask_matches_transformers_assistant_tokens_mask(tmp_path):
    """A BPE tokenizer that transformers and tfllm both load: the same ids, and tfllm's
    mask is transformers' return_assistant_tokens_mask (but a sample's first token)."""
    from keras_hub.src.utils.transformers.export.hf_exporter import export_tokenizer
    from transformers import AutoTokenizer

    from tests.pretrained.transformers_reference import keras_hub_tokenizer
    from tfllm.data.tokenizer import KerasHubTokenizer

    hub = keras_hub_tokenizer("llama3")
    export_tokenizer(hub, str(tmp_path / "hf"))
    hub.save_to_preset(str(tmp_path / "hub"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    source = open(CHATML).read()
    conversation = [{"role": "user", "content": "the cat sat on the mat"},
                    {"role": "assistant", "content": "and the dog ran"},
                    {"role": "user", "content": "in the park"},
                    {"role": "assistant", "content": "with a red ball"}]
    want = hf.apply_chat_template(conversation, chat_template=source, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    sample = SampleEncoder(KerasHubTokenizer(str(tmp_path / "hub")), "messages", "assistant",
                           ChatTemplate(source))(record(conversation))
    assert sample.tokens.tolist() == list(want["input_ids"])
    assert sample.mask.tolist() == list(want["assistant_masks"])


def test_a_template_that_is_not_prefix_preserving_is_refused():
    """Qwen3's format drops the think block of earlier turns: turn-by-turn prefixes
    are not the start of the whole rendering. last_assistant needs only the last."""
    template = ChatTemplate(T.QWEN3)
    encoder = SampleEncoder(ByteTokenizer(), "messages", "assistant", template)
    with pytest.raises(DataError, match="chat.jsonl:1: .*not prefix-preserving") as e:
        encoder(record(T.PLAIN))
    assert "\n" not in str(e.value)
    last = SampleEncoder(ByteTokenizer(), "messages", "last_assistant", template)(
        record(T.PLAIN))
    assert trained_runs(last.tokens, last.mask) == [
        '<think>\n\n</think>\n\n6, which is "six".<|im_end|>\n']


def test_a_sample_with_no_trained_token_is_an_error_naming_it():
    encoder = SampleEncoder(ByteTokenizer(), "messages", "assistant",
                            ChatTemplate(open(CHATML).read()))
    with pytest.raises(DataError, match=r"^chat.jsonl:1: no token is trained"):
        encoder(record([{"role": "user", "content": "hello?"}]))
    short = SampleEncoder(ByteTokenizer(), "messages", "assistant",
                          ChatTemplate(open(CHATML).read()), max_tokens=20)
    with pytest.raises(DataError, match="within its first 20 tokens"):
        short(record(T.PLAIN[1:3]))


def test_prompt_completion_trains_the_completion_and_end_of_document():
    r = Record("pc.jsonl:1", "", prompt="Q: 2+2?\nA:", completion=" 4")
    tok = ByteTokenizer()
    sample = SampleEncoder(tok, "prompt_completion", "completion")(r)
    assert bytes(sample.tokens[:-1].tolist()).decode() == "Q: 2+2?\nA: 4"
    assert sample.tokens[-1] == tok.eod_id
    assert sample.mask.tolist() == [0] * 10 + [1, 1, 1]
    everything = SampleEncoder(tok, "prompt_completion", "all")(r)
    assert everything.mask.tolist() == [0] + [1] * 12


@pytest.mark.parametrize("fmt,loss_on,says", [
    ("text", "assistant", "set data.format=messages"),
    ("messages", "completion", "use train.loss_on=assistant"),
    ("prompt_completion", "last_assistant", "use train.loss_on=completion"),
])
def test_loss_on_must_fit_the_format(fmt, loss_on, says):
    from tfllm.data.chat import check_settings
    config = chat_config(loss_on, fmt)
    with pytest.raises(DataError, match=says):
        check_settings(config.data, loss_on)


# ---- packing and batches ---------------------------------------------------------------
def test_best_fit_decreasing():
    lengths = [5, 3, 7, 2, 4, 1]
    bins = best_fit(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 3  # 22 tokens in bins of 8: the fewest possible


def test_packed_rows_hold_whole_samples_with_no_label_across_them():
    config = chat_config()
    batch = next(chat_batches(config, "train"))
    tokens, segments, mask = (batch[k][0] for k in ("tokens", "segment_ids", "loss_mask"))
    assert tokens.shape == segments.shape == mask.shape == (4, 257)
    template = ChatTemplate(open(CHATML).read())
    for row_tokens, row_segments, row_mask in zip(tokens, segments, mask):
        assert row_segments.max() >= 1
        for s in range(1, row_segments.max() + 1):
            where = np.flatnonzero(row_segments == s)
            assert (np.diff(where) == 1).all()  # one run per sample
            assert row_mask[where[0]] == 0  # nothing predicts a sample's first token
            text = bytes(row_tokens[where].tolist()).decode()
            assert text.startswith("<|im_start|>")  # a whole rendered conversation
            runs = trained_runs(row_tokens[where], row_mask[where])
            assert runs and all(run.endswith(template.end_of_turn().strip()) for run in runs)
        assert (row_mask[row_segments == 0] == 0).all()


def test_state_restores_exactly_and_epochs_reshuffle(tmp_path):
    config = chat_config(rows=2, accum=2)
    first = chat_batches(config, "train")
    for _ in range(3):
        next(first)
    first.save_state(str(tmp_path / "it"))
    expected = [next(first) for _ in range(30)]  # crosses several epochs of each stream
    again = chat_batches(config, "train")
    again.restore_state(str(tmp_path / "it"))
    for want in expected:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    samples = prepare_samples(config.data, ByteTokenizer(), "train", config.train.loss_on)
    stream = PackedStream(samples[::4], 257, seed=7)
    epoch0 = [r[0].tolist() for r in (next(stream) for _ in range(len(stream.epoch_bins(0))))]
    stream.position = 0
    assert [next(stream)[0].tolist() for _ in epoch0] == epoch0
    epoch1 = [next(stream)[0].tolist() for _ in epoch0]
    assert epoch1 != epoch0


def test_validation_reads_once_then_stops():
    config = chat_config(rows=2)
    batches = list(chat_batches(config, "validation"))
    trained = sum(int(b["loss_mask"].sum()) for b in batches)
    assert batches and trained > 0
    assert (batches[-1]["segment_ids"] >= 0).all()
    padded = list(chat_batches(config, "validation", max_batches=len(batches) + 2))
    assert not padded[-1]["loss_mask"].any()
    # Rewound (each evaluation after the first), it reads the same batches again.
    some = chat_batches(config, "validation", max_batches=len(batches) + 2)
    assert len(list(some)) == len(batches) + 2
    some.rewind()
    again = list(some)
    assert len(again) == len(padded)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(again, padded) for k in a)
