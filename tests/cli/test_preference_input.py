"""Bad preference data and settings through `tfllm train`: exit 2, one line naming the
file:line or the setting and the fix, and no run folder left (issue 50)."""

import os

import pytest

from tfllm.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = '{"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5"}'


def _train(tmp_path, line, *extra):
    data = tmp_path / "d.jsonl"
    data.write_text((GOOD + "\n") * 3 + line + "\n")
    return main(["train", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                 "--workdir", str(tmp_path / "run"), "--set", "data.source=text",
                 "--set", "data.format=preference", "--set", "train.objective=dpo",
                 "--set", "lora.rank=4", "--set", f"data.paths=[{data}]",
                 "--set", "data.tokenizer=byte", "--set", "model.vocab_size=257",
                 "--set", "data.sequence_length=64", "--set", "model.max_sequence_length=64",
                 "--set", "train.steps=2", "--set", "train.global_batch_size=2",
                 "--set", "data.validation_fraction=0", "--set", "mesh.axes=data=1",
                 *extra])


# In-process and refused while the data is read or the config checked, before
# TensorFlow builds a model.
@pytest.mark.parametrize("line, extra, says", [
    ('{"prompt": "a", "chosen": "b"}', (), 'd.jsonl:4: "rejected" is missing'),
    ('{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}',
     (), 'd.jsonl:4: "prompt" is not a non-empty list'),
    ('{"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", '
     '"content": "q"}]}', (), "d.jsonl:4: no \"prompt\""),
    (GOOD, ("--set", "train.objective=sft"), "set both train.objective=dpo"),
    # one pair per step cannot split over data=2 without halving a pair
    (GOOD, ("--set", "train.global_batch_size=1", "--set", "mesh.axes=data=2"),
     "preference pairs (two sequences each)"),
])
def test_bad_pairs_and_settings_are_one_line_and_leave_no_run(tmp_path, capsys, line,
                                                              extra, says):
    code = _train(tmp_path, line, *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "run").exists()
