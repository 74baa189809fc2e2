"""From a request body to what the engine is asked: the one rule for fields we do not implement,
the structured output a request asks for (response_format, structured_outputs, vLLM's older
guided_* fields, or a tool choice), and the sampling settings."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from bulletserve.engine.structured import GrammarError, StructuredOutputs
from bulletserve.server.http_errors import APIError
from bulletserve.server.protocol import (
    REFUSED,
    ChatCompletionRequest,
    NamedToolChoice,
    SamplingFields,
    Tool,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S")

_logged_ignored: set[str] = set()
_logged_lock = threading.Lock()


def check_fields(body: SamplingFields) -> None:
    """400 for a field vLLM implements and we do not, set to ask for something; any other field
    we do not know is ignored, as vLLM ignores it, and logged once per name."""
    for name, value in (body.model_extra or {}).items():
        if name in REFUSED:
            if value != REFUSED[name]:
                raise APIError(400, f"{name} is not supported by this server", name)
            continue
        with _logged_lock:
            first = name not in _logged_ignored
            _logged_ignored.add(name)
        if first:
            logger.warning("the request field %r is not one we know: ignored, as vLLM does", name)


def structure_of(body: SamplingFields) -> tuple[StructuredOutputs | None, str | None]:
    """(what the output must match, the field that asked for it), or (None, None). More than one
    way of asking at once is a 400."""
    asked: list[tuple[StructuredOutputs, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append((StructuredOutputs("json_object"), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None and fmt.json_schema.schema_ is not None
        schema = fmt.json_schema.schema_
        asked.append(
            (_made(StructuredOutputs.json_schema, schema, "response_format"), "response_format")
        )
    extras = body.structured_outputs
    if extras is not None and extras.json_object:
        asked.append((StructuredOutputs("json_object"), "structured_outputs.json_object"))
    # (field, its value, the structure it asks for)
    fields = []
    if extras is not None:
        fields += [
            ("structured_outputs.json", extras.json_, StructuredOutputs.json_schema),
            ("structured_outputs.regex", extras.regex, _regex),
            ("structured_outputs.choice", extras.choice, _choice),
            ("structured_outputs.grammar", extras.grammar, _grammar),
        ]
    fields += [
        ("guided_json", body.guided_json, StructuredOutputs.json_schema),
        ("guided_regex", body.guided_regex, _regex),
        ("guided_choice", body.guided_choice, _choice),
        ("guided_grammar", body.guided_grammar, _grammar),
    ]
    asked += [(_made(make, value, name), name) for name, value, make in fields if value is not None]
    if isinstance(body, ChatCompletionRequest):
        tool_structure = _made(tool_choice_structure, body, "tool_choice")
        if tool_structure is not None:
            asked.append((tool_structure, "tool_choice"))
    if len(asked) > 1:
        names = ", ".join(name for _, name in asked)
        raise APIError(400, f"ask for one structured output at a time, not {names}", asked[1][1])
    return asked[0] if asked else (None, None)


def _made(make: Callable[[T], S], value: T, field: str) -> S:
    """`make(value)`, a GrammarError (a spec that cannot be one) a 400 naming `field`."""
    try:
        return make(value)
    except GrammarError as exc:
        raise APIError(400, str(exc), field) from None


def _regex(pattern: str) -> StructuredOutputs:
    return StructuredOutputs("regex", pattern)


def _choice(choices: list[str]) -> StructuredOutputs:
    return StructuredOutputs("choice", choices=tuple(choices))


def _grammar(ebnf: str) -> StructuredOutputs:
    return StructuredOutputs("grammar", ebnf)


def tool_choice_structure(body: ChatCompletionRequest) -> StructuredOutputs | None:
    """What a forced tool call must match, as vLLM constrains it: a named function's
    arguments (its parameters' schema), or for `required` a JSON array of at least one call
    of any of the tools ({"name", "parameters"}); exactly one with `parallel_tool_calls` false."""
    choice, tools = body.tool_choice, body.tools or []
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutputs.json_schema(parameters_schema(tool))
    if choice == "required":
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(t) for t in tools]},
        }
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputs.json_schema(schema)
    return None


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": parameters_schema(tool),
        },
        "required": ["name", "parameters"],
    }


def logit_bias_of(body: SamplingFields) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) with integer keys; 400 for a key that is not
    a token id."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        # ASCII digits alone: str.isdigit takes "²", and int() reads "١٢" as 12.
        token = int(key) if key.isascii() and key.isdigit() else -1
        if token < 0:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        bias[token] = value
    return bias


def tools_for_template(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as Hugging Face chat templates take them (OpenAI's shape, parameters whole)."""
    if not tools:
        return None
    return [json.loads(tool.model_dump_json(by_alias=True, exclude_none=True)) for tool in tools]
