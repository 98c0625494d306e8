"""Chat templates render byte for byte as transformers' apply_chat_template(tokenize=False)."""

import json
import os

import pytest

from tests.data import chat_templates as T
from tfllm.data import DataError
from tfllm.data.chat_template import ChatTemplate, folder_template, load_chat_template
from tfllm.config import Config

CONVERSATIONS = {"plain": T.PLAIN, "tools": T.WITH_TOOLS, "thinking": T.THINKING}
# Mistral and Gemma 3 accept neither tool turns nor a system turn inside the alternation.
ACCEPTS = {"llama3": ("plain", "tools"), "qwen2": ("plain", "tools", "thinking"),
           "qwen3": ("plain", "tools", "thinking"), "mistral": ("plain", "thinking"),
           "gemma3": ("plain", "thinking")}


def hf_tokenizer(family):
    """A transformers tokenizer carrying `family`'s template and special tokens (a
    word-level vocabulary of just those tokens: only the rendering is compared)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    template, specials = T.FAMILIES[family]
    vocab = {"<unk>": 0, **{tok: i + 1 for i, tok in enumerate(sorted(
        set(specials.values()) - {"<unk>"}))}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    tok.chat_template = template
    return tok


def cases():
    for family, names in ACCEPTS.items():
        for name in names:
            for generation_prompt in (False, True):
                yield family, name, generation_prompt


@pytest.mark.parametrize("family,name,generation_prompt", list(cases()))
def test_render_matches_transformers(family, name, generation_prompt, tmp_path):
    tok = hf_tokenizer(family)
    tok.save_pretrained(str(tmp_path))  # transformers 5: chat_template.jinja
    source, specials, _ = folder_template(str(tmp_path))
    ours = ChatTemplate(source, specials)
    messages = CONVERSATIONS[name]
    if generation_prompt:
        messages = messages[:-1]
    tools = T.TOOLS if name == "tools" else None
    want = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=generation_prompt)
    assert ours.render(messages, add_generation_prompt=generation_prompt, tools=tools) == want


def test_template_in_tokenizer_config_and_jinja_file_wins(tmp_path):
    tok = hf_tokenizer("qwen2")
    tok.save_pretrained(str(tmp_path))
    os.remove(tmp_path / "chat_template.jinja")
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = T.GEMMA3
    config_path.write_text(json.dumps(config))
    source, _, origin = folder_template(str(tmp_path))
    assert source == T.GEMMA3 and origin.endswith("(chat_template)")
    (tmp_path / "chat_template.jinja").write_text(T.QWEN2)
    assert folder_template(str(tmp_path))[0] == T.QWEN2


def test_generation_spans_match_transformers_assistant_mask():
    """The character spans of {% generation %} blocks are transformers'
    (return_assistant_tokens_mask reads them from the same rendering)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "tfllm", "data",
                           "templates", "chatml.jinja")) as f:
        source = f.read()
    text, spans = ChatTemplate(source).render_with_spans(T.PLAIN)
    want_text, want_spans = render_jinja_template([T.PLAIN], chat_template=source,
                                                  return_assistant_tokens_mask=True)
    assert (text, spans) == (want_text[0], want_spans[0])
    assert [text[a:b] for a, b in spans] == ["4.<|im_end|>", "6, which is \"six\".<|im_end|>"]


def test_no_template_is_one_line_naming_data_chat_template(tmp_path):
    config = Config()
    config.data.tokenizer, config.data.tokenizer_path = "file", str(tmp_path)
    with pytest.raises(DataError, match="data.chat_template") as e:
        load_chat_template(config.data)
    assert "\n" not in str(e.value)


def test_sandbox_refuses_python_internals():
    import jinja2

    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(jinja2.exceptions.TemplateError, match="nope"):
        ChatTemplate("{{ raise_exception('nope') }}").render([])


def test_end_of_turn_text():
    assert ChatTemplate(T.QWEN2).end_of_turn() == "<|im_end|>\n"
    assert ChatTemplate(T.LLAMA3).end_of_turn() == "<|eot_id|>"
    assert ChatTemplate(T.MISTRAL, {"eos_token": "</s>"}).end_of_turn() == "</s>"
    assert ChatTemplate(T.GEMMA3).end_of_turn() == "<end_of_turn>\n"
