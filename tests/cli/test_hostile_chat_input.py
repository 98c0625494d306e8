"""Hostile chat data and templates through `tfllm train`: exit 2, one line naming the
file:line or the template, and no run folder left (issue 48)."""

import os

import pytest

from tfllm.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


# In-process and refused while the data is read, before TensorFlow builds anything.
@pytest.mark.parametrize("line, template, says", [
    ('{"messages": [{"role": "assistant", "content": null, "tool_calls": "rm -rf /"}]}',
     None, "d.jsonl:2: messages[0].tool_calls is a str"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', None, "lone surrogate"),
    ("[" * 200_000 + "]" * 200_000, None, "d.jsonl:2: JSON nested more than 64"),
    (GOOD, "{{ 10 ** (10 ** 9) }}", "t.jinja"),
    (GOOD, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
           "{% endfor %}", "steps"),
])
def test_hostile_chat_input_is_one_line_and_leaves_no_run(tmp_path, capsys, line, template,
                                                          says):
    data = tmp_path / "d.jsonl"
    data.write_text(GOOD + "\n" + line + "\n")
    path = os.path.join(ROOT, "tfllm", "data", "templates", "chatml.jinja")
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        path = str(tmp_path / "t.jinja")
    run = tmp_path / "run"
    code = main(["train", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                 "--workdir", str(run), "--set", "data.source=text", "--set",
                 "data.format=messages", "--set", f"data.paths=[{data}]", "--set",
                 f"data.chat_template={path}", "--set", "data.tokenizer=byte", "--set",
                 "model.vocab_size=257", "--set", "data.sequence_length=64", "--set",
                 "model.max_sequence_length=64", "--set", "train.steps=2", "--set",
                 "data.validation_fraction=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not run.exists()
