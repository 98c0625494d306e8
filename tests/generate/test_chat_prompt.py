"""`tfllm generate --chat --prompt`: a JSON list of messages is checked as a line of chat
data is (one DataError line), other text is one user message (issue 48, item 2)."""

import pytest

from tfllm.data import DataError
from tfllm.generate.chat import conversation


def test_a_list_of_messages_or_text():
    assert conversation('[{"role": "user", "content": "hi"}]') == [
        {"role": "user", "content": "hi"}]
    for text in ("hello", "[not json", "[1, 2]", "[" * 200_000):
        assert conversation(text) == [{"role": "user", "content": text}]


@pytest.mark.parametrize("prompt, says", [
    ('[{"role": "user", "content": "\\ud800"}]', "lone surrogate"),
    ('[{"role": "assistant", "content": null, "tool_calls": "rm -rf /"}]',
     "tool_calls is a str"),
    ('[{"role": "robot", "content": "hi"}]', "'robot'"),
    ('[{"role": "user", "content": "hi", "x": ' + "[" * 100 + "]" * 100 + "}]",
     "nested more than 64"),
])
def test_a_broken_list_of_messages_is_one_line(prompt, says):
    with pytest.raises(DataError) as e:
        conversation(prompt)
    assert str(e.value).startswith("--prompt: ") and says in str(e.value)
    assert "\n" not in str(e.value)
