"""A reasoning model's output end to end on the embedded default model: a chat template that
opens `<think>` in the prompt (DeepSeek-R1's shape), the deepseek_r1 parser, and a thinking
budget that makes the model close the block (SmolLM2 never writes `</think>` itself): the
reasoning split from the content, a JSON-schema answer and a tool call held to their grammar
after free reasoning, through the openai SDK, whole and with its streaming helpers."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from bulletserve.engine.async_engine import AsyncEngine
from bulletserve.engine.config import EngineConfig
from tests.server.harness import need_tokenizer, running_app

pytestmark = pytest.mark.slow

# SmolLM2's ChatML with the assistant's turn opened on a thinking block, as DeepSeek-R1's
# template ends its prompt with `<think>\n`.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
BUDGET = 12
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}


class Capital(pydantic.BaseModel):
    capital: str = pydantic.Field(max_length=24)


@pytest.fixture(scope="module")
def client():
    """The default model served in-process with the thinking template and deepseek_r1. Slow
    (about 10 s): the model loads and each request reasons before it answers."""
    need_tokenizer()
    engine = AsyncEngine(EngineConfig(max_model_len=1024))
    settings = {
        "served_model_name": "smol",
        "chat_template": THINKING_TEMPLATE,
        "reasoning_parser": "deepseek_r1",
    }
    try:
        with running_app(engine, **settings) as url:
            http = httpx.Client(trust_env=False, timeout=120)
            yield openai.OpenAI(
                base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http
            )
            http.close()
    finally:
        engine.shutdown()


def _reasoning(message: object) -> str:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning_content") or ""


def test_reasoning_then_a_json_schema_answer_whole_and_through_the_streaming_helper(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    budget = {"thinking_token_budget": BUDGET}
    whole = client.chat.completions.parse(
        model="smol", messages=messages, response_format=Capital, max_tokens=80,
        temperature=0, extra_body=budget,
    )  # fmt: skip
    message = whole.choices[0].message
    assert _reasoning(message).strip()  # free text, not held to the schema
    assert isinstance(message.parsed, Capital), message.content
    assert whole.usage.completion_tokens_details.reasoning_tokens > BUDGET
    assert whole.usage.completion_tokens_details.reasoning_tokens < whole.usage.completion_tokens

    with client.chat.completions.stream(
        model="smol", messages=messages, response_format=Capital, max_tokens=80,
        temperature=0, extra_body=budget,
    ) as stream:  # fmt: skip
        content_deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    streamed = final.choices[0].message
    assert "".join(content_deltas) == streamed.content == message.content
    assert _reasoning(streamed) == _reasoning(message)
    assert streamed.parsed == message.parsed


def test_a_tool_call_is_parsed_from_the_answer_not_the_reasoning(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        body = {
            "model": "smol",
            "messages": messages,
            "tools": [WEATHER],
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,  # or SmolLM2 repeats `required`'s call to max_tokens
            "max_tokens": 80,
            "temperature": 0,
            "extra_body": {"thinking_token_budget": BUDGET},
        }
        whole = client.chat.completions.create(**body).choices[0]
        assert _reasoning(whole.message).strip()
        (call,) = whole.message.tool_calls
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)
        assert "get_weather" not in _reasoning(whole.message)

        with client.chat.completions.stream(**body) as stream:
            argument_deltas = [
                e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"
            ]
            final = stream.get_final_completion().choices[0].message
        (streamed,) = final.tool_calls
        assert len(argument_deltas) > 1  # the arguments stream as they are written
        assert "".join(argument_deltas) == streamed.function.arguments
        assert (streamed.function.name, streamed.function.arguments) == (
            call.function.name,
            call.function.arguments,
        )
        assert _reasoning(final) == _reasoning(whole.message)
