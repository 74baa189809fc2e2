"""The reasoning parsers, whole and streamed, on the edge cases vLLM's own tests hold: no start
tag, no end tag, empty output, a newline before `<think>`, a tag cut across deltas; streamed
and whole give the same split. Then behind the real server: the parts in a chat completion's
message and deltas, the reasoning tokens in its usage, a grammar that holds the answer and
not the reasoning, and the template kwargs (the server's default under the request's)."""

from __future__ import annotations

import json

import httpx
import pytest

from bulletserve.server.reasoning import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
    reasoning_tokens,
)
from tests.server.harness import running_app, tiny_engine

CASES = {
    # text: (deepseek_r1's split, qwen3's split)
    "<think>plan</think>answer": (("plan", "answer"), ("plan", "answer")),
    "plan</think>answer": (("plan", "answer"), (None, "plan</think>answer")),
    "\n<think>plan</think>\n\nanswer": (("plan", "\n\nanswer"), ("plan", "\n\nanswer")),
    "<think>still thinking": (("still thinking", None), ("still thinking", None)),
    "just an answer": (("just an answer", None), (None, "just an answer")),
    "": (("", None), (None, "")),
    "<think></think>": (("", None), ("", None)),
    "<think>a</think>b</think>c": (("a", "b</think>c"), ("a", "b</think>c")),
    "<thin": (("<thin", None), (None, "<thin")),
}


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_whole_output_splits_as_vllms_parser_does(name, text):
    expected = CASES[text][0 if name == "deepseek_r1" else 1]
    assert ReasoningParser(name).split(text) == ReasoningSplit(*expected)


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_a_stream_in_any_deltas_sends_the_whole_outputs_split(name, text, step):
    """Deltas of every size (one character: each tag cut at every point); the parts sent
    joined are the whole text's split, and nothing is sent twice."""
    parser = ReasoningParser(name)
    stream = ReasoningStream(parser)
    reasoning, content = [], []
    for end in range(step, len(text) + step, step):
        new_reasoning, new_content = stream.advance(text[:end], finished=end >= len(text))
        reasoning.append(new_reasoning)
        content.append(new_content)
    if not text:
        new_reasoning, new_content = stream.advance("", finished=True)
        reasoning.append(new_reasoning)
        content.append(new_content)
    whole = parser.split(text)
    assert "".join(reasoning) == (whole.reasoning or "")
    assert "".join(content) == (whole.content or "")


def test_a_partial_closing_tag_is_held_back_until_it_is_or_is_not_the_tag():
    stream = ReasoningStream(ReasoningParser("deepseek_r1"))
    assert stream.advance("<think>plan </th", finished=False) == ("plan ", "")
    assert stream.advance("<think>plan </thx", finished=False) == ("</thx", "")
    assert stream.advance("<think>plan </thx</think>ok", finished=True) == ("", "ok")


def test_qwen3_without_thinking_is_all_answer():
    parser = ReasoningParser("qwen3", thinking=False)
    assert parser.split("<think>x</think>y") == ReasoningSplit(None, "<think>x</think>y")


def test_reasoning_tokens_count_through_the_closing_tag():
    pieces = ["<think>", "a", "b", "</th", "ink>", "c", "d"]

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    parser = ReasoningParser("deepseek_r1")
    assert reasoning_tokens(ids, parser.split(decode(ids)), decode) == 5
    open_ended = ids[:3]
    assert reasoning_tokens(open_ended, parser.split(decode(open_ended)), decode) == 3
    qwen = ReasoningParser("qwen3")
    assert reasoning_tokens([5, 6], qwen.split(decode([5, 6])), decode) == 0


# ---- behind the real server (the tiny random model: its outputs never close a block) -------

MESSAGES = [{"role": "user", "content": "Think first, then answer."}]
# A template that shows its `enable_thinking` input, as Qwen3's acts on it.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}no-think{% endif %}"
)


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(max_model_len=256)
    yield engine
    engine.shutdown()


def _chat(url: str, **body: object) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, **body}
    response = httpx.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(url: str, **body: object) -> tuple[str, str, dict]:
    """(reasoning, content, usage) of a streamed chat completion, its deltas joined."""
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True, **body}
    body["stream_options"] = {"include_usage": True}
    reasoning, content, usage = [], [], {}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, trust_env=False, timeout=60
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning.append(delta.get("reasoning_content") or "")
                content.append(delta.get("content") or "")
    return "".join(reasoning), "".join(content), usage


def test_deepseek_r1_puts_an_unclosed_output_in_the_reasoning_whole_and_streamed(engine):
    with running_app(engine, reasoning_parser="deepseek_r1") as url:
        whole = _chat(url)
        message = whole["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]
        assert message["reasoning"] == message["reasoning_content"]
        tokens = whole["usage"]["completion_tokens"]
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": tokens}
        reasoning, content, usage = _streamed(url)
        assert (reasoning, content) == (message["reasoning_content"], "")
        assert usage["completion_tokens_details"] == {"reasoning_tokens": tokens}


def test_qwen3_keeps_an_output_that_opens_no_block_as_the_answer(engine):
    with running_app(engine, reasoning_parser="qwen3") as url:
        message = _chat(url)["choices"][0]["message"]
        assert message["reasoning_content"] is None and message["content"]
        reasoning, content, _ = _streamed(url)
        assert (reasoning, content) == ("", message["content"])


def test_a_grammar_holds_the_answer_not_the_reasoning(engine):
    """With a reasoning parser a structured output starts after `</think>`: the reasoning is
    free text (the random model never closes it: all reasoning, none of it held to JSON,
    where a grammar from the first token would have made it `{...`); with qwen3 and thinking
    off the grammar holds the whole output, which is the answer."""
    with running_app(engine, reasoning_parser="deepseek_r1") as url:
        free = _chat(url, response_format={"type": "json_object"}, max_tokens=24)
        message = free["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]
        held = _chat(url, max_tokens=24)["choices"][0]["message"]["reasoning_content"]
        assert message["reasoning_content"] == held  # greedy, the same as with no grammar
    with running_app(engine, reasoning_parser="qwen3") as url:
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        answer = _chat(url, response_format={"type": "json_object"}, **off)
        assert answer["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_the_servers_default_template_kwargs_reach_the_template_under_the_requests(engine):
    settings = {
        "chat_template": TEMPLATE,
        "default_chat_template_kwargs": {"enable_thinking": False},
    }
    with running_app(engine, **settings) as url:

        def rendered(**body: object) -> str:
            reply = httpx.post(
                url + "/tokenize", json={"messages": MESSAGES, **body}, trust_env=False
            ).json()
            return engine.front.tokenizer.decode(reply["tokens"])

        assert rendered().endswith("no-think")
        assert not rendered(chat_template_kwargs={"enable_thinking": True}).endswith("no-think")


def test_a_thinking_budget_forces_the_reasonings_end_then_the_answer_follows(engine):
    """thinking_token_budget 5: five tokens of reasoning, then `</think>` forced token by
    token, then the answer, held to its grammar (the random model never closes it itself)."""
    end_ids = engine.front.tokenizer.encode("</think>", add_special_tokens=False)
    with running_app(engine, reasoning_parser="deepseek_r1") as url:
        for body in ({}, {"response_format": {"type": "json_object"}}):
            reply = _chat(url, thinking_token_budget=5, max_tokens=24, **body)
            message = reply["choices"][0]["message"]
            assert message["reasoning_content"] and message["content"] is not None
            reasoning = reply["usage"]["completion_tokens_details"]["reasoning_tokens"]
            assert reasoning == 5 + len(end_ids)
            assert reply["usage"]["completion_tokens"] == 24  # max_tokens counts every token
            if body:
                assert message["content"].startswith("{")
            reasoning, content, _ = _streamed(url, thinking_token_budget=5, max_tokens=24, **body)
            assert (reasoning, content) == (message["reasoning_content"], message["content"])


def test_a_thinking_budget_without_a_reasoning_parser_is_refused(engine):
    with running_app(engine) as url:
        body = {"messages": MESSAGES, "thinking_token_budget": 8}
        response = httpx.post(url + "/v1/chat/completions", json=body, trust_env=False)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "thinking_token_budget"


def test_include_reasoning_false_leaves_the_reasoning_out_whole_and_streamed(engine):
    with running_app(engine, reasoning_parser="deepseek_r1") as url:
        body = {"thinking_token_budget": 5, "max_tokens": 16}
        shown = _chat(url, **body)
        hidden = _chat(url, include_reasoning=False, **body)
        message = hidden["choices"][0]["message"]
        assert message["reasoning_content"] is None and message["reasoning"] is None
        assert message["content"] == shown["choices"][0]["message"]["content"]
        assert hidden["usage"] == shown["usage"]  # its tokens still counted
        reasoning, content, _ = _streamed(url, include_reasoning=False, **body)
        assert (reasoning, content) == ("", message["content"])
