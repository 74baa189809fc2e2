"""Tool calling: the tools into the chat template, and the calls out of the model's text.

Four output formats, as vLLM's parsers of the same names read them:

- `hermes` (Qwen2.5, Qwen3, Hermes, and SmolLM2): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks (a block may hold a list of calls), after optional text;
- `llama3_json` (Llama 3.1-3.3): the whole output is a JSON call `{"name": ..., "parameters":
  {...}}` (or several separated by `;`), optionally after `<|python_tag|>`;
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=P>VALUE</parameter>...
  </function></tool_call>` blocks, each value text made the type its tool's schema gives the
  parameter (a string where the schema gives none);
- `mistral` (Mistral, Mixtral, Ministral): after optional text, `[TOOL_CALLS]` and a JSON array
  of `{"name", "arguments"}` (tokenizers before v11), or `[TOOL_CALLS]NAME[ARGS]{...}` once per
  call (v11 and later). `[TOOL_CALLS]` is a special token: a request parsed so keeps special
  tokens in its text (`skip_special_tokens` false).

Which one a model uses is read off its chat template (`--tool-call-parser` overrides). A template
that takes no tools (SmolLM2's) gets them in a system message in the hermes format instead, so
that no request's tools are silently left out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

ToolParserName = Literal["hermes", "llama3_json", "qwen3_coder", "mistral"]
TOOL_PARSERS: tuple[ToolParserName, ...] = ("hermes", "llama3_json", "qwen3_coder", "mistral")

_HERMES_START = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# The keys a call object's arguments may stand under (hermes and mistral write `arguments`,
# llama3_json and a forced `required` array `parameters`).
_ARGUMENT_KEYS = ("arguments", "parameters")
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|(?=</function>)|$)",
    re.DOTALL,
)
# A function's parameters' JSON schemas by name, from the request's tools (qwen3_coder types
# its text values by them).
ToolSchemas = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def with_id(self) -> dict[str, Any]:
        return {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def detect_parser(template: str | None) -> ToolParserName:
    """The output format a chat template asks for: llama3_json for Llama 3.x's templates,
    hermes otherwise (and for templates that take no tools, which get hermes' instructions)."""
    if template and template_takes_tools(template) and _MISTRAL_CALLS in template:
        return "mistral"
    if template and template_takes_tools(template) and "<function=" in template:
        if "<parameter=" in template:
            return "qwen3_coder"
    if template and template_takes_tools(template) and _HERMES_START not in template:
        if _PYTHON_TAG in template or "ipython" in template or '"parameters"' in template:
            return "llama3_json"
    return "hermes"


def tools_system_message(tools: list[dict[str, Any]]) -> dict[str, str]:
    """A system message that gives a template without tool support the tools, in the hermes
    format the parser reads (the format SmolLM2 and Qwen were tuned on)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return {
        "role": "system",
        "content": (
            "You may call one or more functions to answer the user. The functions you can "
            f"call are:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with a JSON object of its name and arguments inside "
            'tags: <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        ),
    }


def calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls as hermes text, for a template that takes no tools
    (it would drop `tool_calls`), so a conversation's earlier calls stay in the prompt."""
    calls = message.pop("tool_calls", None)
    if not calls:
        return message
    blocks = [
        _HERMES_START
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "</tool_call>"
        for c in calls
    ]
    message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
    return message


def may_start_call(text: str, parser: ToolParserName) -> int | None:
    """Where, in text generated so far, a tool call starts or may be starting (a prefix of its
    marker at the end): the streamed content stops there. None: all of it is plain content."""
    if parser in ("hermes", "qwen3_coder", "mistral"):
        marker = _MISTRAL_CALLS if parser == "mistral" else _HERMES_START
        at = text.find(marker)
        if at >= 0:
            return at
        held = _marker_prefix_at_end(text, marker)
        return len(text) - held if held else None
    stripped = text.lstrip()
    if not stripped:
        return 0 if text else None
    if (
        stripped.startswith("{")
        or stripped.startswith(_PYTHON_TAG)
        or _PYTHON_TAG.startswith(stripped)
    ):
        return 0
    return None


def parse_calls(
    text: str, parser: ToolParserName, schemas: ToolSchemas | None = None
) -> tuple[str | None, list[ParsedCall]]:
    """(the content outside the calls, or None where there is none; the calls). Text that does
    not parse as calls is all content. `schemas`: the offered tools' parameters (qwen3_coder)."""
    if parser == "qwen3_coder":
        return _parse_xml_calls(text, schemas or {})
    if parser == "mistral":
        return _parse_mistral_calls(text)
    if parser == "hermes":
        at = text.find(_HERMES_START)
        if at < 0:
            return text, []
        calls: list[ParsedCall] = []
        for block in _HERMES_BLOCK.findall(text[at:]):
            parsed = _json(block)
            items = parsed if isinstance(parsed, list) else [parsed]
            for item in items:
                call = _call(item, ("arguments", "parameters"))
                if call is None:
                    return text, []
                calls.append(call)
        content = text[:at].strip()
        return (content or None), calls
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for piece in _split_top_level(body, ";"):
        call = _call(_json(piece), ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _parse_mistral_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """Mistral's `[TOOL_CALLS]` followed by a JSON array of calls, or by `NAME[ARGS]{...}` once
    per call."""
    at = text.find(_MISTRAL_CALLS)
    if at < 0:
        return text, []
    calls: list[ParsedCall] = []
    for segment in text[at:].split(_MISTRAL_CALLS)[1:]:
        segment = segment.strip()
        if segment.startswith("["):
            parsed = _json(segment)
            for item in parsed if isinstance(parsed, list) else [parsed]:
                call = _call(item, ("arguments", "parameters"))
                if call is None:
                    return text, []
                calls.append(call)
            continue
        name, marked, arguments = segment.partition(_MISTRAL_ARGS)
        parsed = _json(arguments.strip())
        if not marked or not name.strip() or not isinstance(parsed, dict):
            return text, []
        calls.append(ParsedCall(name.strip(), json.dumps(parsed, ensure_ascii=False)))
    content = text[:at].strip()
    return (content or None), calls


def _parse_xml_calls(text: str, schemas: ToolSchemas) -> tuple[str | None, list[ParsedCall]]:
    """qwen3_coder's `<tool_call><function=...><parameter=...>` blocks."""
    at = text.find(_HERMES_START)
    if at < 0:
        return text, []
    calls: list[ParsedCall] = []
    for block in _HERMES_BLOCK.findall(text[at:]):
        function = _FUNCTION.search(block)
        if function is None:
            return text, []
        name = function.group(1).strip()
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments = {
            key.strip(): _typed(value, properties.get(key.strip()))
            for key, value in _PARAMETER.findall(function.group(2))
        }
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
    content = text[:at].strip()
    return (content or None), calls


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the type its schema gives (as vLLM's qwen3_coder parser reads
    it): a string where the schema says string or says nothing, else the value as JSON where
    it parses so (`true`, `3`, `[1, 2]`), the text itself where it does not."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    parsed = _json(value.strip())
    if parsed is None and value.strip() != "null":
        return value
    return parsed


def forced_calls(text: str, named: str | None) -> list[ParsedCall]:
    """The calls of an output constrained by a forced tool choice (`fields.tool_choice_structure`):
    a named function's arguments object, or `required`'s array of {name, parameters}."""
    if named is not None:
        return [ParsedCall(named, json.dumps(json.loads(text), ensure_ascii=False))]
    return [
        ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
        for item in json.loads(text)
    ]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(item: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = next((item[k] for k in argument_keys if k in item), {})
    if isinstance(arguments, str):
        parsed = _json(arguments)
        arguments = parsed if parsed is not None else arguments
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(item["name"], text)


def _outside_strings(text: str) -> Iterator[tuple[int, str]]:
    """Each character of (possibly unfinished) JSON text that is not inside a string literal,
    a string's two quotes included, so that a reader sees where each string opens and closes."""
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                yield i, ch
            continue
        in_string = ch == '"'
        yield i, ch


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside JSON strings, braces and brackets."""
    pieces, depth, start = [], 0, 0
    for i, ch in _outside_strings(text):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == separator and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return [p.strip() for p in pieces if p.strip()]


# ---- calls streamed as they are generated ------------------------------------------------


@dataclass
class PartialCall:
    """A call in text still being generated: its name once whole, its arguments' JSON text so
    far (the raw text, or for qwen3_coder the whole object once the call has ended)."""

    name: str | None
    arguments: str


class CallReader:
    """The calls of one output as it grows, in order: each name once whole, each call's
    arguments' text so far. `read(text)` takes the whole text so far each step and scans JSON
    only past where the last read stopped, so a step costs what it added (a streamed call's
    arguments can run to thousands of characters). For `kind` "named" the output is the
    arguments object; "required" a JSON array of {name, parameters}; "auto" the parser's format
    after any content. qwen3_coder's calls come whole, as each function ends."""

    def __init__(
        self,
        parser: ToolParserName,
        kind: str,
        named: str | None = None,
        schemas: ToolSchemas | None = None,
    ) -> None:
        self.parser, self.kind, self.named, self.schemas = parser, kind, named, schemas or {}
        self._regions: dict[int, _JsonCalls] = {}  # a JSON region's start -> its reader
        self._ended: list[PartialCall] = []  # qwen3_coder's calls whose function has ended

    def read(self, text: str) -> list[PartialCall]:
        if self.kind == "named":
            return [PartialCall(self.named, text.lstrip())]
        if self.kind == "required":
            return self._region(text, 0, len(text))
        if self.parser == "qwen3_coder":
            ended = text.count("</function>")
            if ended > len(self._ended):
                calls = parse_calls(text, self.parser, self.schemas)[1]
                self._ended = [PartialCall(c.name, c.arguments) for c in calls]
            return self._ended[:ended]
        if self.parser == "mistral":
            return self._mistral(text)
        if self.parser == "hermes":
            calls: list[PartialCall] = []
            at = text.find(_HERMES_START)
            while at >= 0:
                start = at + len(_HERMES_START)
                stop = text.find("</tool_call>", start)
                calls += self._region(text, start, stop if stop >= 0 else len(text))
                at = text.find(_HERMES_START, start)
            return calls
        body = _after_space(text, 0)
        if text.startswith(_PYTHON_TAG, body):
            body = _after_space(text, body + len(_PYTHON_TAG))
        return self._region(text, body, len(text)) if text.startswith("{", body) else []

    def _region(self, text: str, start: int, stop: int) -> list[PartialCall]:
        reader = self._regions.get(start)
        if reader is None:
            reader = self._regions[start] = _JsonCalls(start)
        return reader.read(text, stop)

    def _mistral(self, text: str) -> list[PartialCall]:
        """After each `[TOOL_CALLS]`: an array's items, or `NAME[ARGS]` (its name whole once
        the `[ARGS]` marker is) and the arguments' text after it."""
        calls: list[PartialCall] = []
        at = text.find(_MISTRAL_CALLS)
        while at >= 0:
            start = _after_space(text, at + len(_MISTRAL_CALLS))
            at = text.find(_MISTRAL_CALLS, start)
            stop = at if at >= 0 else len(text)
            if text.startswith("[", start):
                calls += self._region(text, start, stop)
                continue
            name, marked, arguments = text[start:stop].partition(_MISTRAL_ARGS)
            # A tail that may be the next call's marker is not arguments (yet).
            held = _marker_prefix_at_end(arguments, _MISTRAL_CALLS)
            arguments = arguments[: len(arguments) - held].strip()
            calls.append(PartialCall(name.strip(), arguments) if marked else PartialCall(None, ""))
        return calls


def _after_space(text: str, at: int) -> int:
    """The index of the first character from `at` on that is not whitespace."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _marker_prefix_at_end(text: str, marker: str) -> int:
    """How many of `text`'s last characters are a proper prefix of `marker`."""
    return next((n for n in range(len(marker) - 1, 0, -1) if text.endswith(marker[:n])), 0)


@dataclass
class _CallSpan:
    """Where one call object's parts lie in the text."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_stop: int | None = None  # None while its arguments are being written


class _JsonCalls:
    """The call objects of JSON text from `start` (objects not inside another object: one
    alone, or an array's items), read a character at a time past where the last read stopped:
    each one's name once its string is whole, and where its arguments value lies."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._calls: list[_CallSpan] = []
        self._containers: list[str] = []  # the open `{` and `[`, outermost first
        self._in_string = self._escaped = False
        self._string_start = 0
        self._top: int | None = None  # how many containers are open inside a call's object
        self._key: str | None = None  # the call's key whose value is next or being read
        self._after_colon = False
        self._value_started = False

    def read(self, text: str, stop: int) -> list[PartialCall]:
        for i in range(self._pos, stop):
            self._step(text, i, text[i])
        self._pos = max(self._pos, stop)
        return [
            PartialCall(c.name, "")
            if c.arguments_start is None
            else PartialCall(c.name, text[c.arguments_start : c.arguments_stop or stop])
            for c in self._calls
        ]

    def _at_top(self) -> bool:
        return self._top is not None and len(self._containers) == self._top

    def _step(self, text: str, i: int, ch: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._at_top():
                    self._string_read(_json(text[self._string_start : i + 1]))
            return
        if self._at_top() and self._after_colon and not self._value_started and not ch.isspace():
            self._value_started = True
            if self._key in _ARGUMENT_KEYS and ch in "{[":
                self._calls[-1].arguments_start = i
        if ch == '"':
            self._in_string, self._string_start = True, i
        elif ch in "{[":
            if ch == "{" and "{" not in self._containers:
                self._calls.append(_CallSpan())
                self._top, self._key, self._after_colon = len(self._containers) + 1, None, False
            self._containers.append(ch)
        elif ch in "}]":
            if self._containers:
                self._containers.pop()
            call = self._calls[-1] if self._calls else None
            if call is not None and self._at_top() and call.arguments_start is not None:
                call.arguments_stop = call.arguments_stop or i + 1
            elif self._top is not None and len(self._containers) < self._top:
                self._top = None  # the call's object closed
        elif ch == ":" and self._at_top():
            self._after_colon, self._value_started = True, False
        elif ch == "," and self._at_top():
            self._key, self._after_colon, self._value_started = None, False, False

    def _string_read(self, value: object) -> None:
        """A string whole at a call's top level: a key, or the name's value."""
        if not self._after_colon:
            self._key = value if isinstance(value, str) else None
        elif self._key == "name" and isinstance(value, str):
            self._calls[-1].name = value


@dataclass
class CallStream:
    """What a streamed choice has sent of its calls: each call's id and name once, then its
    arguments as they grow (only text past what was sent; never a call the request did not
    offer)."""

    ids: list[str]
    sent_arguments: list[int]

    @classmethod
    def start(cls) -> CallStream:
        return cls([], [])

    def advance(
        self, calls: list[PartialCall], offered: frozenset[str] | None
    ) -> list[tuple[int, str | None, str | None, str]]:
        """(index, id where new, name where new, new arguments text) per call that moved."""
        moved = []
        for index, call in enumerate(calls):
            if call.name is None or (offered is not None and call.name not in offered):
                break  # a later call waits for this one's name
            new = index >= len(self.ids)
            if new:
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
            text = call.arguments[self.sent_arguments[index] :]
            if new or text:
                self.sent_arguments[index] = len(call.arguments)
                moved.append(
                    (index, self.ids[index] if new else None, call.name if new else None, text)
                )
        return moved
