"""Tool calls out of model text, in each family's format; where streamed content stops."""

from __future__ import annotations

import json

import pytest

from bulletserve.server.tools import (
    CallReader,
    CallStream,
    ParsedCall,
    calls_as_text,
    detect_parser,
    forced_calls,
    may_start_call,
    parse_calls,
)


def test_hermes_blocks_after_text_and_a_list_in_one_block():
    text = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>[{"name": "b", "arguments": {}}, {"name": "c", "arguments": "{\\"y\\": 2}"}]'
        "</tool_call>"
    )
    content, calls = parse_calls(text, "hermes")
    assert content == "Sure."
    assert calls == [
        ParsedCall("a", '{"x": 1}'),
        ParsedCall("b", "{}"),
        ParsedCall("c", '{"y": 2}'),
    ]


def test_an_unclosed_last_hermes_block_still_parses_and_bad_json_is_content():
    content, calls = parse_calls('<tool_call>{"name": "a", "arguments": {}}', "hermes")
    assert content is None and calls == [ParsedCall("a", "{}")]
    text = "<tool_call>{not json}</tool_call>"
    assert parse_calls(text, "hermes") == (text, [])
    assert parse_calls("just words", "hermes") == ("just words", [])


def test_llama3_json_calls_with_parameters_and_several_separated_by_semicolons():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse_calls(one, "llama3_json") == (
        None,
        [ParsedCall("get_weather", '{"city": "Oslo"}')],
    )
    two = '<|python_tag|>{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "arguments": {}}'
    _, calls = parse_calls(two, "llama3_json")
    assert [c.name for c in calls] == ["a", "b"] and json.loads(calls[0].arguments) == {"s": "x;y"}
    assert parse_calls("It is sunny.", "llama3_json") == ("It is sunny.", [])


@pytest.mark.parametrize(
    "text,parser,cut",
    [
        ("Hello", "hermes", None),
        ("Hello <tool", "hermes", 6),
        ("Hello <tool_call>{", "hermes", 6),
        ("", "llama3_json", None),
        ('  {"na', "llama3_json", 0),
        ("<|python", "llama3_json", 0),
        ("The answer", "llama3_json", None),
    ],
)
def test_where_streamed_content_stops(text, parser, cut):
    assert may_start_call(text, parser) == cut


def test_forced_outputs_and_the_parser_read_off_a_template():
    assert forced_calls('{"city": "Oslo"}', "get_weather") == [
        ParsedCall("get_weather", '{"city": "Oslo"}')
    ]
    assert forced_calls('[{"name": "a", "parameters": {"x": 1}}]', None) == [
        ParsedCall("a", '{"x": 1}')
    ]
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert (
        detect_parser('{% if tools %}Environment: ipython "parameters"{% endif %}') == "llama3_json"
    )
    assert detect_parser("{{ message.content }}") == "hermes"


def test_an_earlier_call_becomes_text_for_a_template_without_tools():
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "a", "arguments": {"x": 1}}}],
    }
    text = calls_as_text(message)["content"]
    assert text.startswith("<tool_call>") and parse_calls(text, "hermes")[1] == [
        ParsedCall("a", '{"x": 1}')
    ]


# Qwen3-Coder's format, as its chat template describes it to the model.
QWEN3_CODER = """I will look it up.
<tool_call>
<function=get_weather>
<parameter=city>
New York
</parameter>
<parameter=days>
3
</parameter>
<parameter=units>
{"temperature": "celsius"}
</parameter>
</function>
</tool_call>
<tool_call>
<function=list_files>
<parameter=path>
007
</parameter>
</function>
</tool_call>"""
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": "object"},
        },
    },
    "list_files": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def test_qwen3_coder_calls_take_their_parameters_types_from_the_tools_schemas():
    content, calls = parse_calls(QWEN3_CODER, "qwen3_coder", SCHEMAS)
    assert content == "I will look it up."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3, "units": {"temperature": "celsius"}}),
        ("list_files", {"path": "007"}),  # a string by its schema, though it reads as a number
    ]
    # Without a schema for a parameter, its value stays text.
    _, (bare, _) = parse_calls(QWEN3_CODER, "qwen3_coder", {})
    assert json.loads(bare.arguments)["days"] == "3"


def test_a_qwen3_coder_block_cut_short_still_parses_and_text_without_one_is_content():
    cut = QWEN3_CODER.split("</function>")[0]  # max_tokens ended it inside the first call
    _, calls = parse_calls(cut, "qwen3_coder", SCHEMAS)
    assert json.loads(calls[0].arguments) == {
        "city": "New York",
        "days": 3,
        "units": {"temperature": "celsius"},
    }
    assert parse_calls("No tools needed.", "qwen3_coder", SCHEMAS) == ("No tools needed.", [])
    assert parse_calls("<tool_call>no function</tool_call>", "qwen3_coder", SCHEMAS)[1] == []
    assert may_start_call("I will look it up.\n<tool", "qwen3_coder") == 19


def test_qwen3_coders_template_is_read_as_its_format():
    template = (
        "{% if tools %}<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>{% endif %}"
    )
    assert detect_parser(template) == "qwen3_coder"


# ---- streamed as generated ----------------------------------------------------------------

STREAMED = {
    # (parser, kind): output text whose calls stream
    ("hermes", "auto"): 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
    '"Paris, \\"FR\\"", "days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {}}\n</tool_call>',
    ("llama3_json", "auto"): '<|python_tag|>{"name": "get_weather", "parameters": {"city": '
    '"Oslo"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
    ("hermes", "required"): '[{"name": "get_weather", "parameters": {"city": "Rome", "n": 3}}, '
    '{"name": "get_time", "parameters": {}}]',
    ("hermes", "named"): '{"city": "Lima", "units": {"t": "C"}}',
    ("qwen3_coder", "auto"): QWEN3_CODER,
    ("mistral", "auto"): 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
    '"Bern"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
}
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern", "days": [1, 2]}'
    '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
)


@pytest.mark.parametrize(("parser", "kind"), list(STREAMED))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_calls_send_each_name_once_and_arguments_as_they_grow(parser, kind, step):
    """Every prefix of the output, `step` characters at a time: the deltas joined give every
    call's name and arguments, equal as JSON to the whole output's parse."""
    text = STREAMED[(parser, kind)]
    named = "get_weather" if kind == "named" else None
    stream, names, arguments = CallStream.start(), {}, {}
    reader = CallReader(parser, kind, named, SCHEMAS)
    for end in [*range(step, len(text), step), len(text)]:
        for index, call_id, name, new in stream.advance(reader.read(text[:end]), None):
            if call_id is not None:
                assert index not in names and name
                names[index] = name
            arguments[index] = arguments.get(index, "") + new
    if kind == "named":
        expected = [ParsedCall(named, json.dumps(json.loads(text)))]
    elif kind == "required":
        expected = forced_calls(text, None)
    else:
        expected = parse_calls(text, parser, SCHEMAS)[1]
    assert [names[i] for i in sorted(names)] == [c.name for c in expected]
    assert [json.loads(arguments[i]) for i in sorted(arguments)] == [
        json.loads(c.arguments) for c in expected
    ]


def test_a_call_of_a_tool_not_offered_is_never_streamed():
    text = '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>'
    calls = CallReader("hermes", "auto").read(text)
    assert CallStream.start().advance(calls, frozenset({"get_weather"})) == []


def test_mistral_calls_in_both_of_its_tokenizers_forms():
    content, calls = parse_calls(STREAMED[("mistral", "auto")], "mistral")
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Bern"}),
        ("get_time", {"zone": "CET"}),
    ]
    content, calls = parse_calls(MISTRAL_V11, "mistral")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Bern", "days": [1, 2]}),
        ("get_time", {"zone": "CET"}),
    ]
    assert parse_calls("[TOOL_CALLS]get_time[ARGS]not json", "mistral")[1] == []
    assert may_start_call("Checking.[TOOL_", "mistral") == 9
    assert detect_parser("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"


@pytest.mark.parametrize("step", [1, 4])
def test_mistral_v11_calls_stream_as_they_are_written(step):
    stream, names, arguments = CallStream.start(), {}, {}
    reader = CallReader("mistral", "auto")
    for end in [*range(step, len(MISTRAL_V11), step), len(MISTRAL_V11)]:
        for index, call_id, name, new in stream.advance(reader.read(MISTRAL_V11[:end]), None):
            if call_id is not None:
                names[index] = name
            arguments[index] = arguments.get(index, "") + new
    assert names == {0: "get_weather", 1: "get_time"}
    assert [json.loads(arguments[i]) for i in (0, 1)] == [
        {"city": "Bern", "days": [1, 2]},
        {"zone": "CET"},
    ]
