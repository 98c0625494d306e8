"""A chat turn: the conversation rendered by the run's chat template with its generation
prompt, the assistant's reply generated until the template's end of turn.

The end of turn is what the template writes right after an assistant reply
(`ChatTemplate.end_of_turn`: "<|eot_id|>", "<|im_end|>", "<end_of_turn>", "</s>", ...).
When it is one token the generator stops on it; otherwise (a byte tokenizer, say) the
generator stops at the end-of-document id or the token budget and the reply is cut where
the end-of-turn text begins.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional

from tfllm.data.chat import added_token_ids, load_object, message_error, text_encoder
from tfllm.data.chat_template import folder_of, load_chat_template
from tfllm.data.errors import DataError
from tfllm.generate.generator import Generator
from tfllm.runpaths import RunPaths


def conversation(prompt: str) -> List[dict]:
    """The messages of `tfllm generate --chat --prompt`: a JSON list of messages ({"role",
    "content"}, typed and bounded as a line of chat data is: `tfllm.data.chat`), or else
    the text of one user message.

    Raises:
      DataError: a JSON list of messages that is no conversation (one line).
    """
    text = prompt.strip()
    if text.startswith("["):
        try:
            messages = json.loads(text)
        except (ValueError, RecursionError):  # not JSON: the text of one message
            messages = None
        if isinstance(messages, list) and messages and all(
                isinstance(m, dict) and "role" in m for m in messages):
            fix = ('give --prompt a JSON list such as [{"role": "user", "content": "..."}], '
                   "or plain text")
            # the checks of a data line: nesting, surrogates, finite numbers, every field
            messages = load_object('{"messages": ' + text + "}", "--prompt", fix)["messages"]
            error = message_error(messages)
            if error:
                raise DataError(f"--prompt: {error}; {fix}.")
            return messages
    return [{"role": "user", "content": prompt}]


class ChatSession:
    """Replies through a run's chat template.

    Args:
      model: the run's built model with its weights.
      parallel: its sharding setup, or None.
      tokenizer: the run's `tfllm.data.tokenizer.Tokenizer`.
      data: the run's data settings (`config.data`: data.chat_template, data.tokenizer_path).
      max_sequence_length: model.max_sequence_length.
      jit_compile: XLA-compile generation.
      run_dir: the run's workdir: when it holds its copy of data.chat_template (what it
        trained with, `store_chat_template`), that copy is the template, not the file the
        config names now; None: the file the settings name (a user's --set).
    """

    def __init__(self, model, parallel, tokenizer, data, max_sequence_length: int,
                 jit_compile: bool = True, run_dir: Optional[str] = None):
        own = run_dir if run_dir and os.path.isfile(
            RunPaths(run_dir).chat_template_file) else None
        try:
            self.template = load_chat_template(data, own)
        except DataError:
            if data.format == "messages":
                raise
            # a run trained on plain text: its data settings never needed a template
            raise DataError(f"--chat needs a chat template, and this run (data.format="
                            f"{data.format}, data.tokenizer={data.tokenizer}) has none; "
                            "generate without --chat, or name one: --set "
                            "data.chat_template=FILE.jinja (e.g. "
                            "tfllm/data/templates/chatml.jinja).") from None
        folder = folder_of(data.tokenizer_path) if data.tokenizer == "file" else None
        self.encode = text_encoder(tokenizer, added_token_ids(folder))
        self.tokenizer, self.limit = tokenizer, max_sequence_length
        self.generator = Generator(model, parallel, jit_compile=jit_compile)
        #: the end-of-turn text (stripped) and the id generation stops on
        self.end_text = self.template.end_of_turn().strip()
        ids = self.encode(self.end_text) if self.end_text else []
        self.stop_id = ids[0] if len(ids) == 1 else tokenizer.eod_id

    def prompt_ids(self, messages: List[dict]) -> List[int]:
        """The conversation rendered with the generation prompt, as token ids."""
        import jinja2
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"the chat template ({self.template.origin}) refused the "
                            f"conversation ({e}); fix the messages.") from None
        return self.encode(text)

    def reply(self, messages: List[dict], max_new_tokens: int, **sampling) -> str:
        """The assistant's next reply to `messages` (its end of turn not included).

        Args:
          messages: the conversation so far.
          max_new_tokens: at most this many tokens.
          **sampling: temperature, top_k, top_p, seed (`Generator.generate`).
        """
        ids = self.prompt_ids(messages)
        if not ids:  # the generator needs at least one token to continue
            raise DataError(f"the chat template ({self.template.origin}) renders the "
                            "conversation as no tokens at all; give a non-empty --prompt, "
                            "or a template that writes the messages.")
        if len(ids) >= self.limit:
            raise DataError(f"the conversation is {len(ids)} tokens with the chat template; "
                            f"model.max_sequence_length is {self.limit}: shorten it.")
        new = self.generator.generate(ids, min(max_new_tokens, self.limit - len(ids)),
                                      eos_id=self.stop_id, **sampling)
        new = [int(i) for i in new if int(i) != self.tokenizer.eod_id]
        text = self.tokenizer.decode(new)
        return text.split(self.end_text)[0] if self.end_text else text


def chat_reply(run, prompt: str, max_new_tokens: int, session: Optional[ChatSession] = None,
               own_template: bool = True, **sampling) -> str:
    """The reply of a restored `tfllm.train.run.Run` to `prompt` (`conversation`).

    Args:
      own_template: the run's own copy of its chat template (what it trained with), when
        it holds one; False: the file data.chat_template names (the user set it now).
    """
    session = session or ChatSession(run.model, run.parallel, run.tokenizer, run.config.data,
                                     run.config.model.max_sequence_length, run.jit_compile,
                                     run.workdir if own_template else None)
    return session.reply(conversation(prompt), max_new_tokens, **sampling)
