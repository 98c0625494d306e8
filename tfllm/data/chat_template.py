"""Chat templates: found beside the tokenizer, rendered by jinja2 as transformers does.

A Hugging Face tokenizer folder keeps its template in `chat_template.jinja` or, in older
folders, in `tokenizer_config.json["chat_template"]` (the .jinja file wins, as in
transformers). `data.chat_template` names a .jinja file instead. The template sees what
`transformers`' `apply_chat_template(tokenize=False)` gives it: `messages` (keys whose
value is None dropped), `tools`, `documents`, `add_generation_prompt` and the tokenizer's
named special tokens (`bos_token`, `eos_token`, ...), in a sandboxed environment with the
same settings (trim_blocks, lstrip_blocks, loop controls, the `raise_exception` and
`strftime_now` globals, a `tojson` that does not escape HTML, a `namespace` that refuses
underscore names) and the `{% generation %}...{% endgeneration %}` tag, whose spans give
the assistant tokens (`return_assistant_tokens_mask`). Tests compare the rendered text
byte for byte with transformers for templates in the formats of Llama 3, Qwen2, Qwen3,
Mistral and Gemma 3.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
from datetime import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from tfllm import files
from tfllm.confined import read_regular
from tfllm.contracts import CHAT_TEMPLATE_FILE
from tfllm.data.errors import DataError
from tfllm.runpaths import RunPaths
from tfllm.data.template_bounds import (MAX_TEMPLATE_CHARS, BoundedEnvironment, TemplateLimit,
                                        budget)

TEMPLATE_FILE = "chat_template.jinja"
#: the most a chat template file may hold (the largest published ones are ~20 KB)
MAX_TEMPLATE_FILE_BYTES = 1 << 20
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
#: the named special tokens transformers passes to a template (its special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
#: the message fields transformers copies a message's reasoning between
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# The spans of the render in progress: (output pieces so far, [(start, end)]), or None.
_TRACKING: contextvars.ContextVar = contextvars.ContextVar("tfllm_generation_spans",
                                                           default=None)


class _GenerationSpans(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders body unchanged and, while a render
    tracks spans, records where body's text lands in the output (character offsets)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_record", []), [], [],
                                      body).set_lineno(lineno)

    def _record(self, caller):
        text = caller()
        state = _TRACKING.get()
        if state is not None:
            pieces, spans = state
            # The pieces the render yielded so far are the output before this block.
            start = sum(len(p) for p in pieces)
            spans.append((start, start + len(text)))
        return text


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace without underscore attributes (no reach into Python internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._refuse(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._refuse(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _refuse(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set the underscore attribute {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def environment() -> BoundedEnvironment:
    """The sandboxed jinja2 environment chat templates are rendered in (transformers'),
    with the bounds on a template's work (`tfllm.data.template_bounds`)."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_GenerationSpans, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


class TemplateFailed(jinja2.exceptions.TemplateError):
    """Any failure of a template while rendering (a Python error, a bound that was hit),
    as one jinja TemplateError: the callers name the sample."""


def _template_line(error: BaseException) -> str:
    """' (line N)': the template line a render failed on (jinja rewrites tracebacks to
    point into the template), or ''."""
    tb, line = error.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line})" if line else ""


def _failure(error: BaseException) -> jinja2.exceptions.TemplateError:
    """A render's failure as a TemplateError in one line (a TemplateError as it is)."""
    if isinstance(error, jinja2.exceptions.TemplateError) and not isinstance(
            error, TemplateLimit):
        return error
    text = " ".join(str(error).split())
    if len(text) > 200:
        text = text[:200] + "..."
    limit = isinstance(error, TemplateLimit)
    kind = "" if limit else f"{type(error).__name__}: "
    return (TemplateLimit if limit else TemplateFailed)(
        f"{kind}{text or type(error).__name__}{_template_line(error)}")


def _plain(value):
    """JSON-like data only, so that nothing but plain values reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def template_messages(messages: Sequence[dict]) -> List[dict]:
    """Messages as transformers hands them to a template: None values dropped, a
    reasoning field copied to `reasoning_content` and `thinking`."""
    out = []
    for message in messages:
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A chat template and the special tokens it is rendered with.

    Args:
      source: the template's jinja text.
      special_tokens: {"bos_token": "<s>", ...}: the named special tokens.
      origin: where the template came from, for error messages.
    """

    def __init__(self, source: str, special_tokens: Optional[Dict[str, str]] = None,
                 origin: str = "chat template"):
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        try:
            with budget():  # compiling folds constants: bounded as a render is
                self._template = environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"{origin}: not a valid jinja template (line {e.lineno}: "
                            f"{e.message}); fix it or name another with "
                            "data.chat_template.") from None
        except Exception as e:  # noqa: BLE001 (RecursionError, MemoryError, a bound...)
            raise DataError(f"{origin}: the chat template cannot be compiled "
                            f"({_failure(e)}); fix it or name another with "
                            "data.chat_template.") from None
        #: whether `{% generation %}` marks the assistant's text
        self.has_generation = bool(_GENERATION_TAG.search(source))

    def _variables(self, messages, add_generation_prompt, tools):
        return dict(self.special_tokens, messages=template_messages(messages),
                    tools=_plain(tools), documents=None,
                    add_generation_prompt=add_generation_prompt)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False,
               tools: Optional[list] = None) -> str:
        """The conversation as text (`apply_chat_template(..., tokenize=False)`).

        Raises:
          jinja2.exceptions.TemplateError: the template refused the conversation
            (`raise_exception`), failed (any error, as `TemplateFailed`) or went past a
            bound of `tfllm.data.template_bounds`; callers name the sample.
        """
        return self._generate(self._variables(messages, add_generation_prompt, tools), [])

    def _generate(self, variables: dict, pieces: list) -> str:
        """The rendered text, its pieces appended to `pieces` as they come, under a
        render's budget; every failure a TemplateError."""
        size = 0
        try:
            with budget():
                for piece in self._template.generate(**variables):
                    size += len(piece)
                    if size > MAX_TEMPLATE_CHARS:
                        raise TemplateLimit(f"the rendered text is longer than "
                                            f"{MAX_TEMPLATE_CHARS:,} characters (the bound "
                                            "on a chat template's output)")
                    pieces.append(piece)
        except Exception as e:  # noqa: BLE001 (a template may fail in any way)
            raise _failure(e) from None
        return "".join(pieces)

    def render_with_spans(self, messages: Sequence[dict], tools: Optional[list] = None
                          ) -> Tuple[str, List[Tuple[int, int]]]:
        """(text, [(start, end)]): the rendered conversation and the character spans of
        its `{% generation %}` blocks, in order."""
        pieces, spans = [], []
        token = _TRACKING.set((pieces, spans))
        try:
            text = self._generate(self._variables(messages, False, tools), pieces)
        finally:
            _TRACKING.reset(token)
        return text, spans

    def end_of_turn(self) -> str:
        """The text the template writes right after an assistant's reply (its end-of-turn
        token and what follows it in that turn, e.g. "<|im_end|>\\n"), found by rendering
        a two-turn probe; "" when the probe cannot tell."""
        probe = "\ue010probe\ue011"
        try:
            text = self.render([{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": probe}])
        except jinja2.exceptions.TemplateError:
            return ""
        at = text.rfind(probe)
        return "" if at < 0 else text[at + len(probe):]


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json keeps it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


#: tokenizer_config.json and special_tokens_map.json: a few KiB to a few MiB (added tokens)
MAX_TOKENIZER_JSON_BYTES = 16 * 2 ** 20


def read_tokenizer_json(path: str):
    """A tokenizer folder's JSON file, read regular and bounded (`tfllm.confined`):
    a FIFO, a device or a file over MAX_TOKENIZER_JSON_BYTES is a DataError."""
    text = read_regular(path, MAX_TOKENIZER_JSON_BYTES, "a tokenizer's JSON file",
                        DataError, "use the tokenizer folder as Hugging Face writes it")
    return json.loads(text.decode("utf-8"))


def _read_json(path: str) -> dict:
    try:
        data = read_tokenizer_json(path)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        text = " ".join(str(e).split())[:160]
        raise DataError(f"{path}: not readable JSON ({text}); fix or remove it.") from None
    return data if isinstance(data, dict) else {}


def folder_of(tokenizer_path: str) -> Optional[str]:
    """The folder a tokenizer's template files live in: data.tokenizer_path itself when
    it is a folder, else the folder of the file (a SentencePiece .model)."""
    if not tokenizer_path:
        return None
    path = os.path.expanduser(tokenizer_path)
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def folder_template(folder: str) -> Tuple[Optional[str], Dict[str, str], str]:
    """(template text or None, special tokens, where the template came from) of a
    tokenizer folder: chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or transformers' list of named templates: the one named "default")."""
    config_path = os.path.join(folder, TOKENIZER_CONFIG)
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    specials = {}
    map_path = os.path.join(folder, SPECIAL_TOKENS_MAP)
    for source in ((_read_json(map_path) if os.path.isfile(map_path) else {}), config):
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(source.get(name))
            if text is not None:
                specials[name] = text
    jinja_path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(jinja_path):
        return read_template(jinja_path, jinja_path), specials, jinja_path
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template, specials, f"{config_path} (chat_template)"
    return None, specials, folder


def read_template(path: str, what: str) -> str:
    """The text of a chat template file: a regular file (a FIFO, a device or a folder is
    refused before a byte is read) of at most `MAX_TEMPLATE_FILE_BYTES`, UTF-8; else one
    DataError line naming `what`."""
    try:
        raw = read_regular(path, MAX_TEMPLATE_FILE_BYTES, "a chat template", DataError,
                           "name a .jinja chat template file")
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what}: not UTF-8 text (byte offset {e.start}); save the "
                        "template as UTF-8.") from None
    except OSError as e:
        raise DataError(f"{what}: cannot read it ({e.strerror or e}); name a .jinja chat "
                        "template file.") from None


def store_chat_template(data, workdir: str) -> Optional[str]:
    """A run's copy of data.chat_template, read as the run starts (`read_template`) and
    written to WORKDIR/chat_template.jinja, which exports and chats of the run read
    instead of the path the config names (anyone may edit a run's config.yaml; an export
    copies only what the run holds). Returns the copy's path, or None without a
    data.chat_template."""
    if not data.chat_template:
        return None
    text = read_template(os.path.expanduser(data.chat_template),
                         f"data.chat_template={data.chat_template}")
    path = RunPaths(workdir).chat_template_file
    files.write_atomically(workdir, path, text)
    return path


def check_stored_template(data, workdir: str) -> None:
    """Raises DataError when the run in `workdir` trained with another template than the
    file data.chat_template names holds now (a resume would render its data differently
    from the run's first steps without a word), as a changed tokenizer is refused."""
    path = RunPaths(workdir).chat_template_file
    if not data.chat_template or os.path.islink(path) or not os.path.isfile(path):
        return  # a run older than the copy, or none named
    now = read_template(os.path.expanduser(data.chat_template),
                        f"data.chat_template={data.chat_template}")
    if now != read_template(path, path):
        raise DataError(f"data.chat_template={data.chat_template} differs from the template "
                        f"this run trained with ({path}); put that one back (cp {path} "
                        f"{data.chat_template}), or start a new --workdir.")


def load_chat_template(data, run: Optional[str] = None) -> ChatTemplate:
    """The chat template the data settings (`config.data`) name: the .jinja file of
    data.chat_template, else the tokenizer folder's own (data.tokenizer_path). Special
    tokens come from the tokenizer folder either way.

    Args:
      data: the run's data settings.
      run: the run's workdir, when the template is for what the run holds (an export, a
        chat with the trained model): data.chat_template is then the run's own copy
        (`store_chat_template`), never the file the config names.

    Raises:
      DataError (one line naming data.chat_template) when there is none.
    """
    folder = folder_of(data.tokenizer_path) if data.tokenizer == "file" else None
    source, specials, origin = (folder_template(folder) if folder and os.path.isdir(folder)
                                else (None, {}, ""))
    if data.chat_template and run is not None:
        origin = RunPaths(run).chat_template_file
        if not os.path.lexists(origin):
            raise DataError(
                f"data.chat_template={data.chat_template}: {run} holds no copy of it "
                f"({CHAT_TEMPLATE_FILE}: runs trained before tfllm kept one), and tfllm "
                "reads only the run's own files here; copy the template the run trained "
                f"with to {origin}, then run the command again.")
        if os.path.islink(origin):
            raise DataError(f"{origin} is a symbolic link; tfllm writes the run's template "
                            "there as a file: replace the link by the template it names.")
        source = read_template(origin, origin)
    elif data.chat_template:
        path = os.path.expanduser(data.chat_template)
        source, origin = read_template(path, f"data.chat_template={data.chat_template}"), path
    if source is None:
        where = (f"data.tokenizer_path={data.tokenizer_path} has neither {TEMPLATE_FILE} "
                 f"nor a chat_template in {TOKENIZER_CONFIG}" if folder
                 else f"data.tokenizer={data.tokenizer} has no chat template")
        raise DataError(f"data.format=messages needs a chat template: {where}; set "
                        "data.chat_template to a .jinja file (e.g. "
                        "tfllm/data/templates/chatml.jinja).")
    return ChatTemplate(source, specials, origin)


def copy_template_files(source: str, folder: str) -> List[str]:
    """Copies a Hugging Face folder's template files (chat_template.jinja,
    tokenizer_config.json, special_tokens_map.json: the template, its special tokens and
    added tokens) into a run's tokenizer `folder`, where `load_chat_template` finds them;
    files `folder` already has are kept. Returns the names copied."""
    copied = []
    if not os.path.isdir(source):
        return copied
    for name in (TEMPLATE_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        src, dst = os.path.join(source, name), os.path.join(folder, name)
        if os.path.isfile(src) and not os.path.lexists(dst):
            files.copy_file(folder, src, name)
            copied.append(name)
    return copied


def export_template(data, folder: str, run: Optional[str] = None) -> Optional[str]:
    """Writes the run's chat template (`load_chat_template`) into an exported Hugging
    Face folder: chat_template.jinja, which transformers reads first, and the
    chat_template of its tokenizer_config.json, for readers that know only that. Returns
    the .jinja path, or None when the run has no template.

    Args:
      run: the run's workdir: a data.chat_template is its own copy, never the path the
        config names (a config.yaml naming ~/.ssh/id_rsa exported that file).
    """
    if data.chat_template and run is not None:
        template = load_chat_template(data, run)  # the run names one: a failure says why
    else:
        try:
            template = load_chat_template(data)
        except DataError:
            return None
    path = os.path.join(folder, TEMPLATE_FILE)
    files.write_atomically(folder, path, template.source)
    config_path = os.path.join(folder, TOKENIZER_CONFIG)
    if os.path.isfile(config_path):
        config = _read_json(config_path)
        config["chat_template"] = template.source
        files.write_atomically(folder, config_path,
                               json.dumps(config, indent=2, ensure_ascii=False))
    return path
