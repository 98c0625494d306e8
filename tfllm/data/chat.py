"""Chat and prompt/completion samples: JSONL readers, the loss mask, token ids.

`data.format=messages`: each line of the JSONL files of data.paths is one conversation,
`{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]?}` with roles system,
user, assistant and tool (an assistant turn may carry `tool_calls` instead of content;
`name`, `tool_call_id` and `reasoning_content` pass through to the template). It is
rendered by the chat template (`tfllm.data.chat_template`) and tokenized.
`data.format=prompt_completion`: each line is `{"prompt": str, "completion": str}`; the
sample is prompt + completion followed by the end-of-document id.

The loss mask (`train.loss_on`) marks the tokens a sample trains on:
  all:            every token (but a sample's first, which nothing predicts);
  completion:     the completion and the end-of-document id (prompt_completion);
  assistant:      every assistant turn, its end-of-turn token included (messages);
  last_assistant: the last assistant turn only (messages).
Assistant text comes from the template's `{% generation %}` spans where it has them
(transformers' `return_assistant_tokens_mask`), widened to take in the end-of-turn text
that follows a span; else from rendering each conversation up to every assistant turn,
with and without the generation prompt, which needs a prefix-preserving template
(refused, naming the sample, when it is not). Character spans become tokens by encoding
the text up to each span boundary: a token that straddles a boundary counts as inside
(as transformers' offsets do). Text between the tokenizer's added tokens (those of
tokenizer_config.json's added_tokens_decoder, e.g. [INST]) is encoded piece by piece
and the added tokens map to their ids, as transformers splits them out first.

A broken line (not JSON, a missing key, an unknown role, a field of the wrong type, a
line over MAX_LINE_BYTES, JSON nested deeper than MAX_JSON_DEPTH, a lone surrogate, a
number that is not finite) is one `DataError` naming file:line; so is a sample with no
trained token.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jinja2
import numpy as np

from tfllm.confined import open_regular
from tfllm.data.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
#: which train.loss_on values each data.format takes
LOSS_ON = {"text": ("all",), "messages": ("all", "assistant", "last_assistant"),
           "prompt_completion": ("all", "completion"),
           # preference pairs: the objective reads the completions whatever loss_on says
           "preference": ("all", "completion")}
_HOLDOUT_BUCKETS = 1 << 20


@dataclass
class Record:
    """One JSONL line: `where` is "file:line"; `messages` (and `tools`) for messages
    data, `prompt` and `completion` for prompt_completion data."""

    where: str
    text: str
    messages: Optional[List[dict]] = None
    tools: Optional[list] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None


@dataclass
class Sample:
    """A tokenized sample: `tokens` (n,) int32 and `mask` (n,) int8, 1 where the token is
    a trained target; `where` names its line."""

    tokens: np.ndarray
    mask: np.ndarray
    where: str


def check_settings(data, loss_on: str) -> None:
    """data.format, data.source and train.loss_on go together; else one line with the fix."""
    if data.format != "text" and data.source not in ("text", "hf"):
        raise DataError(f"data.format={data.format} reads JSONL files from data.paths, or "
                        f"the rows of a Hugging Face dataset: set data.source=text or hf "
                        f"(it is {data.source}).")
    if loss_on not in LOSS_ON[data.format]:
        fix = {"text": "set data.format=messages or prompt_completion (chat data), or "
                       "train.loss_on=all",
               "messages": "use train.loss_on=assistant, last_assistant or all",
               "prompt_completion": "use train.loss_on=completion or all",
               "preference": "use train.loss_on=completion or all (the objective trains "
                             "on the completions)"}[data.format]
        raise DataError(f"train.loss_on={loss_on} does not apply to data.format="
                        f"{data.format}: {fix}.")


#: the longest JSONL line read (one conversation); a longer line is refused unread
MAX_LINE_BYTES = 16 * 2 ** 20
#: the deepest nesting of a line's JSON (arrays and objects; a tool's JSON schema is ~10)
MAX_JSON_DEPTH = 64
#: the optional string fields of a message, passed to the template as they are
_STRING_FIELDS = ("name", "tool_call_id", "reasoning_content", "thinking", "reasoning")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_error(obj) -> Optional[str]:
    """What makes a parsed line unusable whatever its format: nesting deeper than
    MAX_JSON_DEPTH, a lone surrogate (no UTF-8 text), a number that is not finite."""
    stack = [(obj, 1, "")]
    while stack:  # iterative: a line nested 200,000 deep must not recurse
        value, depth, where = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return f"JSON nested more than {MAX_JSON_DEPTH} deep{where and ' at ' + where}"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and _SURROGATE.search(key):
                    return f"a key at {where or 'the top'} holds a lone surrogate (no UTF-8 text)"
                name = (f"{where}[{key}]" if isinstance(value, list) else
                        f"{where}.{key}" if where else str(key))
                stack.append((item, depth + 1, name if len(name) <= 80 else where))
        elif isinstance(value, str) and _SURROGATE.search(value):
            return f"{where or 'a string'} holds a lone surrogate (\\ud800-\\udfff: no UTF-8 text)"
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{where or 'a number'} is {value} (not a finite number)"
    return None


def _tool_call_error(call, where: str) -> Optional[str]:
    """A tool call as OpenAI writes it: {"type"?: "function", "id"?: str, "function":
    {"name": str, "arguments": object or JSON string}}."""
    if not isinstance(call, dict):
        return f"{where} is a {type(call).__name__}, not an object"
    function = call.get("function")
    if not isinstance(function, dict):
        return f"{where}.function is missing or not an object"
    if not isinstance(function.get("name"), str):
        return f"{where}.function.name is missing or not a string"
    if not isinstance(function.get("arguments", {}), (dict, str)):
        return f"{where}.function.arguments is not an object or a JSON string"
    for key in ("id", "type"):
        if key in call and not isinstance(call[key], str):
            return f"{where}.{key} is a {type(call[key]).__name__}, not a string"
    return None


def _message_error(message, i: int) -> Optional[str]:
    if not isinstance(message, dict):
        return f"messages[{i}] is not an object"
    role = message.get("role")
    if role not in ROLES:
        text = repr(role) if isinstance(role, str) and len(role) <= 40 else (
            f"a {type(role).__name__}")
        return f"messages[{i}].role is {text}, not one of {', '.join(ROLES)}"
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            return f"messages[{i}] ({role}) has tool_calls; only an assistant turn calls tools"
        if not isinstance(calls, list):
            return (f"messages[{i}].tool_calls is a {type(calls).__name__}, not a list of "
                    'tool calls ({"function": {"name": ..., "arguments": {...}}})')
        for k, call in enumerate(calls):
            error = _tool_call_error(call, f"messages[{i}].tool_calls[{k}]")
            if error:
                return error
    for key in _STRING_FIELDS:
        if message.get(key) is not None and not isinstance(message[key], str):
            return f"messages[{i}].{key} is a {type(message[key]).__name__}, not a string"
    content = message.get("content")
    if content is None and role == "assistant" and calls:
        return None  # a tool call without text, as OpenAI writes it
    if "content" not in message:
        return f"messages[{i}] ({role}) has no content"
    if not isinstance(content, str):
        return (f"messages[{i}].content ({role}) is {type(content).__name__}, not a string "
                "(multimodal content parts are not supported)")
    return None


def _refuse_constant(name):
    raise ValueError(f"{name} is not a finite number")


def load_object(line: str, where: str, fix: str) -> dict:
    """One JSONL line as a JSON object, checked whatever its format (`_json_error`);
    DataError naming `where` and ending with `fix` otherwise."""
    try:
        obj = json.loads(line, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg} at column {e.colno}); {fix}.") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} deep; "
                        f"{fix}.") from None
    except ValueError as e:  # NaN/Infinity, an integer of more digits than Python reads
        text = " ".join(str(e).split(":")[0].split())[:120]
        raise DataError(f"{where}: not usable JSON ({text}); {fix}.") from None
    error = _json_error(obj)
    if error:
        raise DataError(f"{where}: {error}; {fix}.")
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object; {fix}.")
    return obj


def message_error(messages, key: str = "messages") -> Optional[str]:
    """What makes `messages` no conversation (a non-empty list of typed messages), naming
    the field as `key`; None when it is one."""
    if not isinstance(messages, list) or not messages:
        return f'"{key}" is not a non-empty list of messages'
    for i, message in enumerate(messages):
        error = _message_error(message, i)
        if error:
            return error.replace("messages[", f"{key}[", 1)
    return None


def tools_ok(tools) -> bool:
    """Whether a line's "tools" is absent or a list of JSON schemas (objects)."""
    return tools is None or (isinstance(tools, list) and all(isinstance(t, dict)
                                                             for t in tools))


def parse_line(line: str, where: str, fmt: str) -> Record:
    """One JSONL line of data.format `fmt` as a Record; DataError naming `where` and the fix."""
    fix = {"messages": 'each line must be {"messages": [{"role": "user", "content": "..."}, '
                       '...]}',
           "prompt_completion": 'each line must be {"prompt": "...", "completion": "..."}'}[fmt]
    obj = load_object(line, where, fix)
    if fmt == "prompt_completion":
        for key in ("prompt", "completion"):
            if not isinstance(obj.get(key), str):
                what = "missing" if key not in obj else f"a {type(obj[key]).__name__}"
                raise DataError(f"{where}: \"{key}\" is {what}, not a string; {fix}.")
        return Record(where, line, prompt=obj["prompt"], completion=obj["completion"])
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if "messages" not in obj else "not a non-empty list"
        raise DataError(f"{where}: \"messages\" is {what}; {fix}.")
    for i, message in enumerate(messages):
        error = _message_error(message, i)
        if error:
            raise DataError(f"{where}: {error}; {fix}.")
    tools = obj.get("tools")
    if not tools_ok(tools):
        raise DataError(f"{where}: \"tools\" is not a list of JSON schemas (objects); {fix}.")
    return Record(where, line, messages=messages, tools=tools)


def _lines(path: str):
    """(number, text) of every line of a JSONL file, each read with a bound
    (MAX_LINE_BYTES: a longer line is refused before it is read whole) and decoded as
    UTF-8; DataError naming path:line otherwise."""
    with open_regular(path, None, "a JSONL data file", DataError,
                      "name a JSONL file in data.paths") as f:
        number = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES:,} "
                                "bytes (the bound on one sample's JSON); split or shorten "
                                "the sample.")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{number}: not UTF-8 ({e.reason} at byte {e.start} "
                                "of the line); re-encode the file as UTF-8.") from None


def read_records(files: Sequence[str], fmt: str, parse: Optional[Callable] = None) -> list:
    """Every non-blank line of the JSONL `files` as a Record, in order.

    Args:
      files: the JSONL files.
      fmt: data.format.
      parse: parse(line, "file:line", fmt) -> record; default `parse_line` (SFT formats;
        `tfllm.data.preference.parse_line` for preference pairs).
    """
    parse = parse or parse_line
    records = []
    for path in files:
        for number, line in _lines(path):
            if line.strip():
                records.append(parse(line, f"{path}:{number}", fmt))
    return records


def held_out(record: Record, fraction: float) -> bool:
    """Whether a record is validation data: a hash of its line below `fraction` (stable
    across runs and independent of order, as the text sources' holdout)."""
    digest = hashlib.sha256(record.text.strip().encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % _HOLDOUT_BUCKETS < fraction * _HOLDOUT_BUCKETS


def render_record(template, record, messages, generation_prompt: bool, what: str) -> str:
    """`messages` of `record` (a chat sample or a preference pair, `what`) rendered
    through `template`; a template's refusal is one DataError line naming the record."""
    try:
        return template.render(messages, add_generation_prompt=generation_prompt,
                               tools=record.tools)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"{record.where}: the chat template ({template.origin}) refused the "
                        f"conversation ({e}); fix the {what} or use another template "
                        "(data.chat_template).") from None


def tokenizer_config(folder: Optional[str]) -> dict:
    """A tokenizer folder's tokenizer_config.json as a dict; {} when there is none or it is
    not a JSON object (the template's own read of the file names what is wrong with it)."""
    import os

    from tfllm.data.chat_template import TOKENIZER_CONFIG, read_tokenizer_json
    path = os.path.join(folder, TOKENIZER_CONFIG) if folder else ""
    if not path or not os.path.isfile(path):
        return {}
    try:
        config = read_tokenizer_json(path)
    except (OSError, ValueError, RecursionError, DataError):
        return {}
    return config if isinstance(config, dict) else {}


def added_token_ids(folder: Optional[str]) -> Dict[str, int]:
    """{text: id} of a tokenizer folder's added tokens (tokenizer_config.json's
    added_tokens_decoder), which transformers splits out of text before encoding."""
    decoder = tokenizer_config(folder).get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        return {}
    return {entry["content"]: int(i) for i, entry in decoder.items()
            if isinstance(entry, dict) and isinstance(entry.get("content"), str)
            and entry["content"] and str(i).isdigit() and len(str(i)) < 10}


def text_encoder(tokenizer, added: Dict[str, int]) -> Callable[[str], List[int]]:
    """encode(text) -> ids: the tokenizer's, with `added` tokens mapped to their ids and
    the text between them encoded piece by piece."""
    if not added:
        return tokenizer.encode
    pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))

    def encode(text: str) -> List[int]:
        ids, at = [], 0
        for match in pattern.finditer(text):
            if match.start() > at:
                ids += tokenizer.encode(text[at:match.start()])
            ids.append(added[match.group()])
            at = match.end()
        if at < len(text):
            ids += tokenizer.encode(text[at:])
        return ids
    return encode


def span_mask(encode, text: str, spans: Sequence[Tuple[int, int]]) -> Tuple[List[int], np.ndarray]:
    """(ids of text, int8 mask of the tokens overlapping any character span)."""
    ids = encode(text)
    mask = np.zeros(len(ids), np.int8)

    def token_at(char: int, end: bool) -> int:
        if char <= 0:
            return 0
        if char >= len(text):
            return len(ids)
        prefix = encode(text[:char])
        common = 0
        for a, b in zip(prefix, ids):
            if a != b:
                break
            common += 1
        # A token of the whole text that straddles the boundary overlaps the span.
        return common + 1 if end and common < len(prefix) else common
    for start, stop in spans:
        if stop > start:
            mask[token_at(start, False):token_at(stop, True)] = 1
    return ids, mask


class SampleEncoder:
    """Records -> Samples: rendering, the loss mask of train.loss_on, token ids.

    Args:
      tokenizer: a `tfllm.data.tokenizer.Tokenizer`.
      fmt: data.format (messages or prompt_completion).
      loss_on: train.loss_on.
      template: the `ChatTemplate` (messages data).
      added: the tokenizer folder's added tokens (`added_token_ids`).
      max_tokens: a longer sample is cut to its first max_tokens tokens.
    """

    def __init__(self, tokenizer, fmt: str, loss_on: str, template=None,
                 added: Optional[Dict[str, int]] = None, max_tokens: int = 0):
        self.tokenizer, self.fmt, self.loss_on = tokenizer, fmt, loss_on
        self.template, self.max_tokens = template, max_tokens
        self.encode = text_encoder(tokenizer, added or {})
        #: what the template writes after an assistant reply (its end-of-turn text)
        self.end_of_turn = template.end_of_turn() if template is not None else ""
        #: samples cut to max_tokens so far
        self.truncated = 0

    def _render(self, record: Record, messages, generation_prompt: bool = False) -> str:
        return render_record(self.template, record, messages, generation_prompt, "sample")

    def _assistant_spans(self, record: Record) -> Tuple[str, List[Tuple[int, int]]]:
        messages = record.messages
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.template.has_generation:
            try:
                text, spans = self.template.render_with_spans(messages, record.tools)
            except jinja2.exceptions.TemplateError:
                text = self._render(record, messages)  # raises the sample's error
            eot = self.end_of_turn
            # A span that stops before the end-of-turn text: the end of turn is trained too.
            spans = [(a, b + len(eot)) if eot and not text[a:b].endswith(eot)
                     and text.startswith(eot, b) else (a, b) for a, b in spans]
            if self.loss_on == "last_assistant":
                spans = spans[-1:]
            return text, spans
        text = self._render(record, messages)
        if self.loss_on == "last_assistant":
            turns = turns[-1:]
        spans = []
        for i in turns:
            before = self._render(record, messages[:i], generation_prompt=True) if i else ""
            through = self._render(record, messages[:i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"{record.where}: the chat template ({self.template.origin}) is not "
                    f"prefix-preserving (rendered up to assistant turn {i} it is not the start "
                    "of the whole conversation), so its assistant tokens cannot be found; use "
                    "a template with {% generation %} markers (data.chat_template, e.g. "
                    "tfllm/data/templates/chatml.jinja) or train.loss_on=last_assistant/all.")
            spans.append((len(before), len(through)))
        return text, spans

    def __call__(self, record: Record) -> Sample:
        if self.fmt == "prompt_completion":
            text = record.prompt + record.completion
            spans = [(0 if self.loss_on == "all" else len(record.prompt), len(text))]
            ids, mask = span_mask(self.encode, text, spans)
            ids.append(self.tokenizer.eod_id)  # trained with the completion
            mask = np.append(mask, np.int8(1))
        elif self.loss_on == "all":
            text = self._render(record, record.messages)
            ids, mask = span_mask(self.encode, text, [(0, len(text))])
        else:
            text, spans = self._assistant_spans(record)
            ids, mask = span_mask(self.encode, text, spans)
        tokens = np.asarray(ids, np.int32)
        if self.max_tokens and len(tokens) > self.max_tokens:
            tokens, mask = tokens[:self.max_tokens], mask[:self.max_tokens]
            self.truncated += 1
        mask = mask.astype(np.int8)
        if len(mask):
            mask[0] = 0  # a sample's first token is predicted by nothing
        if not mask.any():
            cut = (f" within its first {self.max_tokens} tokens (data.sequence_length + 1)"
                   if self.max_tokens and len(ids) > self.max_tokens else "")
            raise DataError(f"{record.where}: no token is trained{cut} with train.loss_on="
                            f"{self.loss_on}; give the sample an assistant reply (or "
                            "completion), shorten it or raise data.sequence_length, or "
                            "remove it.")
        return Sample(tokens, mask, record.where)
