"""The chat path through the CLI: an imported Hugging Face folder keeps its chat template,
`tfllm export --format hf` writes it back, `tfllm train` fine-tunes on messages data and
`tfllm generate --chat` replies through the template."""

import json
import os

import pytest

from tests.data import chat_templates as T
from tests.cli.chat_runs import EXAMPLE, imported_llama
from tfllm.cli.main import main
from tfllm.data.chat import Record, SampleEncoder, added_token_ids
from tfllm.data.chat_template import load_chat_template
from tfllm.data.tokenizer import from_file

MESSAGES = T.PLAIN[1:]  # Llama 3's format puts the system turn first anyway


def test_import_keeps_the_template_and_export_writes_it_back(tmp_path):
    from transformers import AutoTokenizer

    config = imported_llama(tmp_path)
    template = load_chat_template(config.data)
    assert template.source == T.LLAMA3
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = hf.apply_chat_template(MESSAGES, tokenize=False)
    assert template.render(MESSAGES) == text
    # the run tokenizes the rendered chat as transformers does (special tokens single ids)
    tokenizer = from_file(config.data.tokenizer_path)
    sample = SampleEncoder(tokenizer, "messages", "assistant", template,
                           added_token_ids(config.data.tokenizer_path))(
        Record("x:1", "", messages=MESSAGES))
    assert sample.tokens.tolist() == hf.apply_chat_template(MESSAGES, tokenize=True,
                                                            return_dict=False)
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "hf"]) == 0
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == T.LLAMA3
    assert exported.apply_chat_template(MESSAGES, tokenize=False) == text


@pytest.mark.slow  # imports, trains, evaluates and generates: ~40 s on two cores
def test_sft_on_an_imported_model_then_chat(tmp_path, capsys):
    # Llama 3's system header alone is ~60 tokens of the tests' small BPE
    imported_llama(tmp_path, "--set", "model.max_sequence_length=256")
    run = str(tmp_path / "run")
    # the example set without its tool conversations: their tool schemas alone fill 256
    # tokens of this BPE in Llama 3's system header
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(line for line in open(EXAMPLE) if '"tools"' not in line))
    settings = {"data.source": "text", "data.format": "messages",
                "data.paths": f"[{chats}]", "train.loss_on": "assistant",
                "data.sequence_length": 256,
                "train.global_batch_size": 4, "train.steps": 4,
                "train.eval_every": 2, "train.eval_steps": 2, "train.sample_tokens": 0,
                "data.validation_fraction": 0.1, "mesh.axes": "data=2"}
    args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    assert main(["train", "--workdir", run, *args]) == 0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_loss" in r]
    assert evals and all(0 <= r["eval_accuracy"] <= 1 and r["eval_tokens"] > 0 for r in evals)
    capsys.readouterr()
    assert main(["generate", "--workdir", run, "--chat", "--prompt", "hello there",
                 "--max-new-tokens", "8"]) == 0
    reply = capsys.readouterr().out
    assert "<|eot_id|>" not in reply and "<|start_header_id|>" not in reply
