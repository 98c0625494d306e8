"""What the chat and preference command-line tests share: a tiny Llama 3 folder written by
transformers, imported as a run with a Llama 3 style chat template."""

import json
import os

from tests.data import chat_templates as T
from tests.pretrained import transformers_reference as ref
from tfllm.cli.main import main
from tfllm.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "tfllm", "data", "chat_example.jsonl")


def imported_llama(tmp_path, *import_args):
    """A tiny Llama 3 folder written by transformers, with a Llama 3 style template in its
    tokenizer_config.json, imported as a run."""
    ref.save("llama3", tmp_path / "hf")
    config_path = tmp_path / "hf" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(chat_template=T.LLAMA3, bos_token="<|begin_of_text|>",
                  eos_token="<|eot_id|>")
    config_path.write_text(json.dumps(config))
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), *import_args]) == 0
    return load_config(str(tmp_path / "run" / "config.yaml"))
