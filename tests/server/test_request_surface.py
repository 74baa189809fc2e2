"""Every request field a production client sends is honoured or refused, through the official
`openai` SDK against the real server (tiny random model; greedy where outputs are compared):
structured outputs, tool calls, the sampling controls, n and best_of, echo, /tokenize."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from bulletserve.model.tokenizer import load_tokenizer
from tests.server.harness import running_app, tiny_engine, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog and"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {
                "type": "object",
                "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["zip"],
            },
        },
        "required": ["name", "address"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "boolean"},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
    },
    "anyOf": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
        "required": ["value"],
    },
}


def tokenizer_with_template(folder: Path, template: Path) -> str:
    """The default model's tokenizer saved with another chat template."""
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = template.read_text()
    tokenizer.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module", params=["chunked", "bullet"])
def policy(request):
    return request.param


@pytest.fixture(scope="module")
def engine(policy):
    engine = tiny_engine(max_model_len=512, policy=policy)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with running_app(engine, enable_auto_tool_choice=True) as base_url:
        yield base_url


@pytest.fixture
def client(url):
    http = httpx.Client(trust_env=False, timeout=120)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
    http.close()


def chat(client, **kwargs):
    kwargs.setdefault("model", "tiny")
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(**kwargs)


def greedy(client, **kwargs) -> str:
    """A greedy completion's text."""
    text = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, **kwargs
    )
    return text.choices[0].text


# ---- structured outputs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_are_valid_json_of_the_schema(client, name):
    schema = SCHEMAS[name]
    response = chat(
        client,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
        max_tokens=200,
        temperature=1.0,
        seed=7,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_vllm_structured_outputs_on_both_endpoints(client):
    text = chat(client, response_format={"type": "json_object"}, max_tokens=200, seed=3)
    if text.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text.choices[0].message.content), dict)
    choice = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
    )
    assert choice.choices[0].text in ("yes", "no", "maybe so")
    regex = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, extra_body={"guided_regex": r"[0-9]{3}-[a-c]+"}
    )
    assert regex.choices[0].text[:4][:3].isdigit() and regex.choices[0].text[3] == "-"
    grammar = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    text_out = out.choices[0].text
    if out.choices[0].finish_reason == "stop":
        assert text_out.startswith("(") and text_out.endswith(")") and text_out[1:-1].isdigit()


def test_a_streamed_constrained_output_parses(client):
    stream = chat(
        client,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "e", "schema": SCHEMAS["enum"]},
        },
        stream=True,
        max_tokens=60,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert json.loads(text)["color"] in ("red", "green", "blue")


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "nonsense"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
        {"structured_outputs": {"regex": "(unclosed"}},
        {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
        {"guided_json": "{not json"},
        {"guided_regex": "a+", "guided_choice": ["a"]},
    ],
    ids=["type", "no-schema", "bad-schema", "bad-regex", "bad-grammar", "not-json", "two"],
)
def test_a_bad_structure_is_a_400_naming_its_field(url, extra):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] and error["param"].split(".")[0] in {*extra, "response_format"}


# ---- tool calls ----------------------------------------------------------------------------


def test_a_named_tool_choice_always_parses_into_a_call(client):
    response = chat(
        client,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=1,
    )
    message = response.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_gives_calls_of_the_given_tools(client):
    response = chat(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
    choice = response.choices[0]
    if choice.finish_reason == "length":
        pytest.skip("the random model's array of calls outran max_tokens")
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_forced_call_streams_its_arguments_as_they_are_generated(client):
    """A forced tool choice streams the call's id and name once and its arguments in the steps
    that write them (it once sent empty deltas, then every call whole at the end); no chunk
    says nothing. Joined, they are the whole response's call. (`required`'s array streams by
    the same code: its random calls outrun any max_tokens here, so tests/server/
    test_tool_parsers.py streams it from text.)"""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(tools=[WEATHER], tool_choice=tool_choice, max_tokens=300, temperature=0)
    whole = chat(client, **kwargs).choices[0]
    if whole.finish_reason == "length":
        pytest.skip("the random model's calls outran max_tokens")
    calls: dict[int, dict[str, str]] = {}
    argument_chunks = 0
    for chunk in chat(client, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason
        assert delta.role or delta.content or delta.tool_calls or finish, chunk
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
            argument_chunks += bool(call.function.arguments)
    assert argument_chunks > len(calls)  # the arguments came over several chunks
    expected = [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected


def test_tool_choice_auto_parses_a_call_and_streams_it_as_deltas(client):
    """The random model is made to write a hermes call (a regex beside tool_choice "auto"); the
    auto parser must find it, whole and streamed, and leave no call markup in the content."""
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    call_text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    regex = "Let me check\\. " + call_text.replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(tools=[WEATHER], tool_choice="auto", extra_body={"guided_regex": regex})
    message = chat(client, **kwargs).choices[0].message
    assert message.content == "Let me check."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == {
        "city": "Paris",
        "unit": "celsius",
    }
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check. " or content.strip() == "Let me check."
    assert "<tool_call>" not in content and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"])["city"] == "Paris"


def test_parallel_tool_calls_false_returns_one_call_whole_and_streamed(client):
    """Two hermes calls written (a regex beside "auto"): with parallel_tool_calls false the
    first alone, whole and streamed; `required` is held to one call by its grammar."""
    calls_text = "".join(
        f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': city}})}"
        "\n</tool_call>"
        for city in ("Paris", "Rome")
    )
    regex = calls_text.replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(tools=[WEATHER], tool_choice="auto", extra_body={"guided_regex": regex})
    both = chat(client, **kwargs).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in both] == ["Paris", "Rome"]
    (first,) = chat(client, parallel_tool_calls=False, **kwargs).choices[0].message.tool_calls
    assert json.loads(first.function.arguments) == {"city": "Paris"}
    streamed: dict[int, str] = {}
    for chunk in chat(client, stream=True, parallel_tool_calls=False, **kwargs):
        for call in chunk.choices[0].delta.tool_calls or ():
            streamed[call.index] = streamed.get(call.index, "") + (call.function.arguments or "")
    assert list(streamed) == [0] and json.loads(streamed[0]) == {"city": "Paris"}
    required = chat(
        client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=200
    ).choices[0]
    assert len(required.message.tool_calls) == 1 and required.finish_reason == "tool_calls"


def test_a_qwen3_coder_call_is_parsed_whole_and_streamed(engine):
    """The same under --tool-call-parser qwen3_coder: the random model made to write its XML
    call; the parameters come back typed by the tool's schema."""
    call_text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>"
    )
    regex = "Let me check\\. " + call_text
    kwargs = dict(tools=[WEATHER], tool_choice="auto", extra_body={"guided_regex": regex})
    with (
        running_app(engine, enable_auto_tool_choice=True, tool_call_parser="qwen3_coder") as url,
        httpx.Client(trust_env=False, timeout=120) as http,
    ):
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, http_client=http)
        message = chat(client, **kwargs).choices[0].message
        assert message.content == "Let me check."
        (call,) = message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        arguments, content = "", ""
        for chunk in chat(client, stream=True, **kwargs):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or ())
        assert "<tool_call>" not in content
        assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}


def test_an_auto_call_of_a_tool_not_offered_stays_content(client):
    call = {"name": "delete_everything", "arguments": {}}
    call_text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    regex = call_text.replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(tools=[WEATHER], tool_choice="auto", extra_body={"guided_regex": regex})
    choice = chat(client, **kwargs).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason != "tool_calls"
    assert choice.message.content == call_text
    content, finish = "", None
    for chunk in chat(client, stream=True, **kwargs):
        assert not chunk.choices[0].delta.tool_calls
        content += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == call_text and finish != "tool_calls"


def test_auto_tool_choice_needs_the_flag(engine):
    with running_app(engine) as base:
        body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2}
        response = httpx.post(base + "/v1/chat/completions", json=body, trust_env=False)
        assert response.status_code == 400 and "--enable-auto-tool-choice" in response.text
        body["tool_choice"] = "none"
        assert httpx.post(base + "/v1/chat/completions", json=body, trust_env=False).is_success


# ---- sampling controls ---------------------------------------------------------------------------


def test_penalties_and_logit_bias_change_greedy_outputs_as_specified(client):
    plain = greedy(client)
    assert (
        greedy(client, frequency_penalty=2.0) != plain
        or greedy(client, presence_penalty=2.0) != plain
    )
    assert greedy(client, extra_body={"repetition_penalty": 2.0}) != plain
    forced = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"1000": 100}
    )
    assert forced.usage.completion_tokens == 6
    tokenizer = load_tokenizer(None)
    assert forced.choices[0].text == tokenizer.decode([1000] * 6)
    first = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1
    )
    top_token = first.choices[0].logprobs.tokens[0]
    top_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(top_token))[0]
    banned = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(top_id): -100}
    )
    assert banned.choices[0].text != first.choices[0].text


def test_min_p_one_is_greedy_and_stop_token_ids_stop(client):
    plain = greedy(client)
    drawn = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.5,
        seed=5,
        extra_body={"min_p": 1.0},
    )
    assert drawn.choices[0].text == plain
    tokens = (
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0
        )
        .choices[0]
        .logprobs.tokens
    )
    tokenizer = load_tokenizer(None)
    third = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(tokens[2]))[0]
    stopped = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [third]},
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3


def test_bad_words_and_allowed_token_ids(client):
    tokenizer = load_tokenizer(None)
    plain = greedy(client)
    word = plain.split()[0]
    avoided = greedy(client, extra_body={"bad_words": [word]})
    assert word not in avoided.split()
    only = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=5,
        temperature=1.0,
        extra_body={"allowed_token_ids": [1000, 2000]},
    )
    assert only.choices[0].text == tokenizer.decode(
        tokenizer.encode(only.choices[0].text, add_special_tokens=False)
    )
    assert set(tokenizer.encode(only.choices[0].text, add_special_tokens=False)) <= {1000, 2000}


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/v1/completions", {"presence_penalty": 2.5}),
        ("/v1/completions", {"frequency_penalty": -3}),
        ("/v1/completions", {"repetition_penalty": 0}),
        ("/v1/completions", {"min_p": 1.5}),
        ("/v1/completions", {"logit_bias": {"5": 101}}),
        ("/v1/completions", {"logit_bias": {"x": 1}}),
        ("/v1/completions", {"logit_bias": {"99999999": 1}}),
        ("/v1/completions", {"stop_token_ids": [99999999]}),
        ("/v1/completions", {"best_of": 1, "n": 2}),
        ("/v1/completions", {"best_of": 3, "stream": True}),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"prompt_logprobs": 21}),
        ("/v1/chat/completions", {"top_logprobs": 2}),
        ("/v1/chat/completions", {"use_beam_search": True}),
        ("/v1/completions", {"cache_salt": ""}),
        ("/v1/completions", {"priority": 3}),
        ("/v1/completions", {"n": 129}),
        ("/v1/chat/completions", {"tool_choice": "required"}),
    ],
)
def test_out_of_range_or_unimplemented_fields_are_a_400_naming_them(url, path, extra):
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})
    response = httpx.post(url + path, json={**base, **extra}, trust_env=False, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    named = error["param"] or error["message"]
    assert any(name in named or name in error["message"] for name in extra)


def test_fields_vllm_also_ignores_are_ignored(url):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "frobnicate": 1, "user": "u"}
    body.update({"use_beam_search": False, "priority": 0, "skip_special_tokens": True})
    assert httpx.post(url + "/v1/completions", json=body, trust_env=False).status_code == 200


# ---- n, best_of, lists of prompts, echo -------------------------------------------------------


def test_cache_salt_keeps_one_clients_prompt_from_another(url):
    """`usage.prompt_tokens_details.cached_tokens` told a client whether another had sent a
    prompt it guessed; with a salt it finds only what its own salt cached."""
    prompt = list(range(200, 200 + 80))  # five full blocks

    def cached(**extra) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra}
        answer = httpx.post(url + "/v1/completions", json=body, trust_env=False).json()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="victim") == 0
    assert cached() == 0 and cached(cache_salt="attacker") == 0
    assert cached(cache_salt="victim") > 0


def test_n_choices_share_the_prompts_blocks(client, engine):
    prompt = list(range(100, 100 + 160))  # ten full blocks of 16
    before = engine.stats()
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=11
    )
    after = engine.stats()
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.text for c in response.choices}) > 1  # seed, seed + 1, seed + 2
    assert response.usage.prompt_tokens == 160 and response.usage.completion_tokens == 24
    # The second and third choice found the prompt's blocks cached (all but the last block,
    # whose last token is recomputed to sample from).
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * 144
    again = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=11
    )
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    assert wait_until(lambda: engine.stats().num_running == 0)


def test_streamed_n_choices_come_indexed(client):
    texts: dict[int, str] = {}
    finished = set()
    stream = chat(client, n=2, max_tokens=6, stream=True, temperature=1.0, seed=2)
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts.values())


def test_a_list_of_prompts_and_best_of(client):
    response = client.completions.create(
        model="tiny", prompt=["one two", "three four", "five"], max_tokens=4, n=2, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3, 4, 5]
    assert response.choices[0].text == response.choices[1].text  # greedy: one answer per prompt
    single = client.completions.create(
        model="tiny", prompt="three four", max_tokens=4, temperature=0
    )
    assert response.choices[2].text == single.choices[0].text
    best = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        best_of=4,
        n=2,
        temperature=1.0,
        seed=9,
        logprobs=0,
    )
    sums = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert len(best.choices) == 2 and sums[0] >= sums[1]
    assert best.usage.completion_tokens == 4 * 6


def test_echo_puts_the_prompt_before_the_text(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    # With logprobs, the prompt's tokens and logprobs come first (none for its first token).
    scored = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    logprobs = scored.choices[0].logprobs
    size = scored.usage.prompt_tokens
    assert len(logprobs.tokens) == size + 4 and logprobs.token_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert scored.choices[0].text == echoed.choices[0].text


def test_prompt_logprobs_and_echo_with_logprobs(url):
    """vLLM's `prompt_logprobs` on both endpoints (every choice gets the prompt's), and the
    legacy `echo` + `logprobs`, which put the prompt's tokens and logprobs before the output's,
    streamed or not."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    post = lambda path, extra: httpx.post(  # noqa: E731
        url + path, json={**body, **extra}, trust_env=False, timeout=120
    ).json()
    both = post("/v1/completions", {"prompt_logprobs": 2, "n": 2, "echo": True, "logprobs": 1})
    size = both["usage"]["prompt_tokens"]
    ids = httpx.post(url + "/tokenize", json={"prompt": PROMPT}, trust_env=False).json()["tokens"]
    assert len(ids) == size
    for choice in both["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries == both["choices"][0]["prompt_logprobs"]
        assert len(entries) == size and entries[0] is None
        for token, entry in zip(ids[1:], entries[1:], strict=True):
            assert str(token) in entry and 1 <= len(entry) <= 3  # the token and the top two
            assert entry[str(token)]["rank"] >= 1
            best = max(entry.values(), key=lambda e: e["logprob"])
            assert best["rank"] == 1
        legacy = choice["logprobs"]
        assert len(legacy["tokens"]) == size + 3
        assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
        for position in range(1, size):
            expected = entries[position][str(ids[position])]["logprob"]
            assert legacy["token_logprobs"][position] == pytest.approx(expected)
            assert len(legacy["top_logprobs"][position]) <= 1
        assert legacy["text_offset"] == sorted(legacy["text_offset"])
        assert choice["text"].startswith(PROMPT)
    chat_body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "prompt_logprobs": 0}
    chat = httpx.post(url + "/v1/chat/completions", json=chat_body, trust_env=False).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the token alone
    plain = post("/v1/completions", {})
    assert plain["choices"][0]["prompt_logprobs"] is None
    streamed = httpx.post(
        url + "/v1/completions",
        json={**body, "echo": True, "logprobs": 1, "stream": True},
        trust_env=False,
        timeout=120,
    )
    chunks = [
        json.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    tokens = [t for chunk in chunks for c in chunk["choices"] for t in c["logprobs"]["tokens"]]
    assert tokens == both["choices"][0]["logprobs"]["tokens"]


# ---- /tokenize and /detokenize -----------------------------------------------------------------


def test_tokenize_and_detokenize(url):
    tokenizer = load_tokenizer(None)
    tokens = httpx.post(url + "/tokenize", json={"prompt": PROMPT}, trust_env=False).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 512
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, trust_env=False)
    assert text.json()["prompt"] == tokenizer.decode(tokens["tokens"])
    chat_ids = httpx.post(url + "/tokenize", json={"messages": MESSAGES}, trust_env=False).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat_ids["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, trust_env=False)
    assert bad.status_code == 400


# ---- each family's tool format -----------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "minus four degrees"},
]


@pytest.mark.parametrize(
    "template,marker",
    [
        ("qwen2.5-tools.jinja", "<tool_call>"),
        ("llama3.1-tools.jinja", '"parameters"'),
        (None, "<tool_call>"),
    ],
    ids=["qwen2.5", "llama3.1", "smollm2-default"],
)
def test_each_familys_template_takes_the_tools_and_round_trips_a_call(tmp_path, template, marker):
    tokenizer = tokenizer_with_template(tmp_path, TEMPLATES / template) if template else None
    engine = tiny_engine(max_model_len=1024, tokenizer=tokenizer)
    try:
        with running_app(engine, enable_auto_tool_choice=True) as base:
            body = {"messages": CONVERSATION, "tools": [WEATHER]}
            ids = httpx.post(base + "/tokenize", json=body, trust_env=False).json()["tokens"]
            text = httpx.post(base + "/detokenize", json={"tokens": ids}, trust_env=False).json()
            prompt = text["prompt"]
            assert "get_weather" in prompt and "minus four degrees" in prompt and marker in prompt
            assert "Oslo" in prompt  # the earlier call, back in the prompt
            http = httpx.Client(trust_env=False, timeout=120)
            client = openai.OpenAI(
                base_url=base + "/v1", api_key="x", max_retries=0, http_client=http
            )
            response = chat(
                client,
                messages=CONVERSATION,
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            call = response.choices[0].message.tool_calls[0]
            jsonschema.validate(
                json.loads(call.function.arguments), WEATHER["function"]["parameters"]
            )
            http.close()
    finally:
        engine.shutdown()


def test_a_clients_request_id_names_the_response(client):
    response = client.completions.create(
        model="tiny", prompt="hi", max_tokens=2, extra_body={"request_id": "mine-1"}
    )
    assert response.id == "cmpl-mine-1"
    again = chat(client, max_tokens=2, extra_body={"request_id": "mine-1"})
    assert again.id == "chatcmpl-mine-1"


def test_a_chat_template_given_to_the_server_replaces_the_tokenizers(engine):
    """vLLM's --chat-template (a file or the template inline): chat and /tokenize render with
    it."""
    template = (TEMPLATES / "llama3.1-tools.jinja").read_text()
    body = {"messages": MESSAGES, "return_token_strs": False}
    with running_app(engine, chat_template=template) as url:
        tokens = httpx.post(url + "/tokenize", json=body, trust_env=False).json()["tokens"]
        text = httpx.post(url + "/detokenize", json={"tokens": tokens}, trust_env=False).json()
        answer = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
            trust_env=False,
        )
    assert "<|start_header_id|>user<|end_header_id|>" in text["prompt"]
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens"] == len(tokens)
