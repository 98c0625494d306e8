"""`tfllm generate --chat`: the prompt goes through the template, the reply stops at the
template's end of turn."""

import os

from tests.data import chat_templates as T
from tfllm.config import Config
from tfllm.data.tokenizer import ByteTokenizer
from tfllm.generate.chat import ChatSession, conversation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHATML = os.path.join(ROOT, "tfllm", "data", "templates", "chatml.jinja")


class Scripted:
    """A generator that 'generates' fixed ids, cut at eos as the real one cuts them."""

    def __init__(self, ids):
        self.ids, self.calls = ids, []

    def generate(self, prompt_ids, max_new_tokens, eos_id=None, **sampling):
        self.calls.append((list(prompt_ids), max_new_tokens, eos_id))
        out = self.ids[:max_new_tokens]
        return out[:out.index(eos_id)] if eos_id in out else out


def session(template_path=CHATML, vocab=257):
    config = Config()
    config.data.tokenizer, config.data.chat_template = "byte", template_path
    return ChatSession(None, None, ByteTokenizer(), config.data, max_sequence_length=vocab)


def test_prompt_is_rendered_with_the_generation_prompt_and_reply_cut_at_end_of_turn(
        monkeypatch):
    monkeypatch.setattr("tfllm.generate.chat.Generator", lambda *a, **k: None)
    chat = session()
    chat.generator = Scripted(list(b"Paris.<|im_end|>\n<|im_start|>user\nmore"))
    assert chat.reply(conversation("Capital of France?"), 64) == "Paris."
    prompt, _, eos = chat.generator.calls[0]
    assert bytes(prompt).decode() == ("<|im_start|>user\nCapital of France?<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    # <|im_end|> is many byte tokens: generation stops at end of document, the text is cut
    assert eos == ByteTokenizer().eod_id and chat.end_text == "<|im_end|>"


def test_a_single_token_end_of_turn_stops_generation(monkeypatch, tmp_path):
    """With an added token for the end of turn (as <|eot_id|>), generation stops on it."""
    import json
    monkeypatch.setattr("tfllm.generate.chat.Generator", lambda *a, **k: None)
    (tmp_path / "tokenizer.model").write_bytes(b"")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": T.LLAMA3, "bos_token": "<|begin_of_text|>",
        "added_tokens_decoder": {"300": {"content": "<|eot_id|>", "special": True}}}))
    config = Config()
    config.data.tokenizer, config.data.tokenizer_path = "file", str(tmp_path / "tokenizer.model")
    chat = ChatSession(None, None, ByteTokenizer(), config.data, max_sequence_length=400)
    assert chat.stop_id == 300


def test_conversation_takes_a_json_list_of_messages():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    import json
    assert conversation(json.dumps(messages)) == messages
    assert conversation("[not json") == [{"role": "user", "content": "[not json"}]


def test_a_template_that_renders_nothing_is_one_line(monkeypatch, tmp_path):
    import pytest
    from tfllm.data.errors import DataError
    monkeypatch.setattr("tfllm.generate.chat.Generator", lambda *a, **k: None)
    empty = tmp_path / "empty.jinja"
    empty.write_text("{% for m in messages %}{% endfor %}")
    chat = session(str(empty))
    chat.generator = Scripted([1, 2])
    with pytest.raises(DataError, match=r"renders the conversation as no tokens at all"):
        chat.reply(conversation(""), 8)
    assert chat.generator.calls == []  # refused before generating


def test_chat_on_a_text_run_without_a_template_says_how_to_name_one(monkeypatch):
    import pytest
    from tfllm.data.errors import DataError
    monkeypatch.setattr("tfllm.generate.chat.Generator", lambda *a, **k: None)
    config = Config()
    config.data.tokenizer = "byte"  # data.format=text, no template anywhere
    with pytest.raises(DataError) as e:
        ChatSession(None, None, ByteTokenizer(), config.data, max_sequence_length=64)
    assert "data.format=messages" not in str(e.value)
    assert "this run (data.format=text" in str(e.value) and "without --chat" in str(e.value)


def test_a_chat_uses_the_template_the_run_trained_with(monkeypatch, tmp_path):
    # the run keeps its copy of data.chat_template (read as it started); the file the
    # config names may have changed, or (a downloaded run) name any file of the user's
    from tfllm.data.chat_template import store_chat_template
    monkeypatch.setattr("tfllm.generate.chat.Generator", lambda *a, **k: None)
    user = tmp_path / "chat.jinja"
    user.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    config = Config()
    config.data.tokenizer, config.data.chat_template = "byte", str(user)
    store_chat_template(config.data, str(tmp_path / "run"))
    user.write_text("{% for m in messages %}<changed>{% endfor %}")
    own = ChatSession(None, None, ByteTokenizer(), config.data, 257,
                      run_dir=str(tmp_path / "run"))
    assert bytes(own.prompt_ids(conversation("hi"))).decode() == "[hi]"
    named = ChatSession(None, None, ByteTokenizer(), config.data, 257)  # named with --set
    assert bytes(named.prompt_ids(conversation("hi"))).decode() == "<changed>"
