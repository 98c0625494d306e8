"""Chat and prompt/completion JSONL is input: every broken line is one DataError naming
file:line (never a traceback), read with a bound, and what it accepts renders."""

import json
import random

import pytest

from tfllm.data import DataError
from tfllm.data import chat
from tfllm.data.chat import SampleEncoder, parse_line, read_records
from tfllm.data.chat_template import ChatTemplate
from tfllm.data.tokenizer import ByteTokenizer
from tests.data import chat_templates as T
from tests.data.datasets import CHATML

GOOD = {"messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "weather",
                                                       "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"}],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]}
PROMPT = {"prompt": "2+2=", "completion": "4"}


def one_line(error):
    message = str(error)
    assert message.startswith("data.jsonl:") and "\n" not in message, message
    return message


@pytest.mark.parametrize("line,says", [
    ("[" * 200_000 + "]" * 200_000, "nested more than"),
    ('{"messages": [{"role": "assistant", "content": null, "tool_calls": 5}]}',
     "tool_calls is a int, not a list"),
    # a string is no list of tool calls (it was trained as one call per character)
    ('{"messages": [{"role": "assistant", "content": null, "tool_calls": "rm -rf /"}]}',
     "tool_calls is a str, not a list"),
    ('{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": '
     '{"name": 3}}]}]}', "function.name"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    ('{"messages": [{"role": "user", "content": "a", "name": 5}]}', "name is a int"),
    ('{"messages": [{"role": "user", "content": "a"}], "tools": [5]}', '"tools"'),
    ('{"messages": [{"role": "user", "content": "a"}], "n": NaN}', "not a finite"),
    ('{"messages": [{"role": "user", "content": "a"}], "n": 1e999}', "not a finite"),
    ('{"messages": [{"role": "user", "content": "a"}], "n": ' + "9" * 5000 + "}",
     "not usable JSON"),
])
def test_hostile_lines_are_one_error_naming_the_line(line, says):
    with pytest.raises(DataError) as e:
        parse_line(line, "data.jsonl:1", "messages")
    assert says in one_line(e.value)


def test_a_line_past_the_bound_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(chat, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "data.jsonl"
    good = json.dumps(PROMPT)
    path.write_text(good + "\n" + json.dumps({"prompt": "x" * 5000, "completion": ""})
                    + "\n")
    with pytest.raises(DataError, match=r"data.jsonl:2: a line longer than 1,000 bytes"):
        read_records([str(path)], "prompt_completion")


def test_invalid_utf8_and_a_fifo_are_one_line(tmp_path):
    import os
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(PROMPT).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: not UTF-8"):
        read_records([str(path)], "prompt_completion")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="FIFO"):
        read_records([str(fifo)], "prompt_completion")


def _mutations(rng, value, depth=0):
    """`value` with one random damage: a type swapped, a huge or non-finite number, deep
    nesting, a lone surrogate, a key dropped."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(sorted(value))
        if rng.random() < 0.1:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: _mutations(rng, value[key], depth + 1)}
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        return value[:i] + [_mutations(rng, value[i], depth + 1)] + value[i + 1:]
    return rng.choice([5, -1, 2.5, True, None, "x", "rm -rf /", [], {}, [[["deep"]]],
                       "\ud800", 10 ** 40, float("inf"), [1] * 3, {"a": "b"},
                       json.loads("[" * 100 + "]" * 100)])


def test_fuzz_lines_are_refused_in_one_line_or_render():
    """Seeded: random truncations, type swaps, deep nesting, huge numbers and surrogates
    of a good line; each is one DataError or a record that renders and tokenizes."""
    rng = random.Random(48)
    # the families' real templates read tool_calls, tools and reasoning fields
    chats = [SampleEncoder(ByteTokenizer(), "messages", loss_on, ChatTemplate(*source))
             for loss_on, source in (("all", (open(CHATML).read(),)),
                                     ("assistant", T.FAMILIES["llama3"]),
                                     ("last_assistant", T.FAMILIES["qwen3"]))]
    completions = SampleEncoder(ByteTokenizer(), "prompt_completion", "all")
    for case in range(400):
        fmt = "messages" if case % 3 else "prompt_completion"
        good = GOOD if fmt == "messages" else PROMPT
        line = json.dumps(_mutations(rng, good))
        if case % 4 == 0:  # a truncation
            line = line[:rng.randrange(len(line) + 1)]
        try:
            record = parse_line(line, f"data.jsonl:{case}", fmt)
        except DataError as e:
            one_line(e)
            continue
        for encode in (chats if fmt == "messages" else [completions]):
            try:
                encode(record)
            except DataError as e:  # e.g. a template refusing a role order
                one_line(e)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "[1, 2]",
                                  '{"added_tokens_decoder": [1]}',
                                  '{"added_tokens_decoder": {"1' + "0" * 30 + '": '
                                  '{"content": "x"}}}'])
def test_a_hostile_tokenizer_config_is_one_line_or_ignored(tmp_path, text):
    from tfllm.data.chat import added_token_ids
    from tfllm.data.chat_template import folder_template
    (tmp_path / "tokenizer_config.json").write_text(text)
    assert added_token_ids(str(tmp_path)) == {}
    try:
        assert folder_template(str(tmp_path))[0] is None
    except DataError as e:  # nested too deep: named, in one line
        assert "tokenizer_config.json: not readable JSON" in str(e) and "\n" not in str(e)
