"""Bad input, the API key, the body limit and engine faults: OpenAI-shaped errors, no hangs."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.server.harness import running_app, serving, tiny_engine, wait_until

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with running_app(engine, max_request_bytes=64 * 1024) as base_url:
        yield base_url


def post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(url + path, trust_env=False, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[1, 2]", b'{"prompt": "hi", "max_tokens": "many"}', b'{"max_tokens": 3}'],
    ids=["malformed", "not-an-object", "wrong-type", "no-prompt"],
)
def test_malformed_or_mistyped_bodies_are_400(url, content):
    response = post(url, "/v1/completions", content=content)
    error_of(response, 400)
    headers = {"content-type": "application/json"}
    error_of(post(url, "/v1/completions", content=content, headers=headers), 400)


def test_wrong_type_names_the_field(url):
    error = error_of(post(url, "/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400)
    assert error["param"] == "temperature"


def test_unknown_model_is_404(url):
    body = {"model": "gpt-9", "prompt": "hi", "max_tokens": 2}
    error = error_of(post(url, "/v1/completions", json=body), 404)
    assert "gpt-9" in error["message"] and error["param"] == "model"
    body = {"model": "gpt-9", "messages": MESSAGES}
    error_of(post(url, "/v1/chat/completions", json=body), 404)


def test_prompt_plus_max_tokens_beyond_the_context_names_both_numbers(url, engine):
    prompt = [5] * 200
    error = error_of(post(url, "/v1/completions", json={"prompt": prompt, "max_tokens": 100}), 400)
    assert "256" in error["message"] and "200" in error["message"] and "100" in error["message"]
    error = error_of(post(url, "/v1/completions", json={"prompt": [5] * 256}), 400)
    assert "256" in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": MESSAGES, "n": 0},
        {"messages": MESSAGES, "top_p": 0},
        {"messages": MESSAGES, "stop": [""]},
        {"messages": MESSAGES, "max_tokens": 4, "min_tokens": 5},
        {"messages": [{"role": "user"}], "temperature": -1},
    ],
    ids=["empty-messages", "n=0", "top_p=0", "empty-stop", "min>max", "negative-temperature"],
)
def test_bad_chat_requests_are_400(url, body):
    error_of(post(url, "/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize(
    "prompt",
    [[], ["a", ""], [[1], []], [10**9], ""],
    ids=["empty", "blank-of-two", "empty-of-two-ids", "oov", "blank"],
)
def test_bad_prompts_are_400(url, prompt):
    error_of(post(url, "/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400)


SURROGATE = '"a\\ud800b"'  # JSON's escape of a lone UTF-16 surrogate


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": %s}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}],'
            ' "stream": true}',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", '{"prompt": [%s], "max_tokens": 2}', "prompt.0"),
        ("/v1/completions", '{"prompt": %s, "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": "hi", "stop": [%s]}', "stop.0"),
        ("/v1/completions", '{"prompt": "hi", "logit_bias": {%s: 1}}', "logit_bias"),
        ("/tokenize", '{"prompt": %s}', "prompt"),
    ],
    ids=["chat", "chat-part-streamed", "prompt-list", "prompt", "stop", "key", "tokenize"],
)
def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(url, path, body, param):
    """JSON lets a client escape half a UTF-16 pair; no tokenizer takes one (it answered 500
    with two tracebacks where it reached the tokenizer, and a stop string took it)."""
    headers = {"content-type": "application/json"}
    response = post(url, path, content=(body % SURROGATE).encode(), headers=headers)
    error = error_of(response, 400)
    assert error["param"].startswith(param) and "surrogate" in error["message"]


def test_unknown_fields_are_ignored(url):
    body = {"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1}, "user": "u"}
    assert post(url, "/v1/completions", json=body).status_code == 200


def test_oversized_body_is_413(url):
    big = {"prompt": "word " * 20_000, "max_tokens": 1}
    error_of(post(url, "/v1/completions", json=big), 413)

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"word " * 200
        yield b'"}'

    headers = {"content-type": "application/json"}
    error_of(post(url, "/v1/completions", content=chunked(), headers=headers), 413)


def test_api_key_guards_v1_only(engine):
    with running_app(engine, api_key="sekrit") as url:
        get = lambda path, **kw: httpx.get(url + path, trust_env=False, **kw)  # noqa: E731
        error_of(get("/v1/models"), 401)
        error_of(get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        body = {"prompt": "hi", "max_tokens": 2}
        error_of(post(url, "/v1/completions", json=body), 401)
        error_of(get("/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
        auth = {"Authorization": "Bearer sekrit"}
        assert get("/v1/models", headers=auth).status_code == 200
        # The scheme is case-insensitive (RFC 7235).
        assert get("/v1/models", headers={"Authorization": "bearer sekrit"}).status_code == 200
        assert post(url, "/v1/completions", json=body, headers=auth).status_code == 200
        assert get("/health").status_code == 200
        assert get("/metrics").status_code == 200


def _logged(caplog, message: str) -> str:
    """The text of the fault logged under the error id that `message` (a client's) names:
    the client sees the id, never the fault's own text."""
    match = re.search(r"error id (err-[0-9a-f]+)", message)
    assert match and "injected" not in message
    records = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert records, f"nothing logged under {match.group(1)}"
    return repr(records[0].exc_info[1])


def test_an_engine_fault_fails_requests_with_500_and_the_server_exits(caplog):
    engine = tiny_engine()

    def broken_execute(works, out=None):
        raise RuntimeError("injected device fault")

    try:
        with serving(engine) as (url, server, thread):
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
            engine.engine.runner.execute = broken_execute
            body = {"prompt": "hello", "max_tokens": 4}
            error = error_of(post(url, "/v1/completions", json=body), 500)
            assert "injected device fault" in _logged(caplog, error["message"])
            thread.join(15)  # a dead engine ends the server, for its supervisor to restart it
            assert not thread.is_alive()
        assert server.engine_failure == "RuntimeError: injected device fault"
        assert any("the engine has died" in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()


def test_a_fault_mid_stream_ends_the_stream_with_an_error_event(caplog):
    engine = tiny_engine()
    real_execute = engine.engine.runner.execute
    calls = 0

    def fails_on_the_fifth_step(works, out=None):
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("injected device fault")
        return real_execute(works, out)

    engine.engine.runner.execute = fails_on_the_fifth_step
    try:
        with running_app(engine) as url:
            body = {"prompt": "hello", "max_tokens": 50, "stream": True, "ignore_eos": True}
            response = post(url, "/v1/completions", json=body)
            assert response.status_code == 200
            events = [line for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: ") :])["error"]
            assert "injected device fault" in _logged(caplog, error["message"])
    finally:
        engine.shutdown()


def test_beyond_max_waiting_requests_is_429():
    engine = tiny_engine(max_num_seqs=1)
    real_execute = engine.engine.runner.execute

    def slowed(works, out=None):
        # Seconds for the running request, so it cannot end (at its context length) and let
        # the queued one in before the third request arrives.
        time.sleep(0.01)
        return real_execute(works, out)

    engine.engine.runner.execute = slowed
    try:
        with running_app(engine, max_waiting_requests=1) as url:
            long = {"prompt": "hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            with httpx.Client(trust_env=False, timeout=30) as client:
                # One request runs; only once it does, the next one comes and waits behind it
                # (sent together, the second could find the first not yet admitted: waiting).
                with client.stream("POST", url + "/v1/completions", json=long) as running:
                    assert running.status_code == 200
                    assert wait_until(lambda: len(engine.engine.running) == 1, timeout_s=5)
                    with client.stream("POST", url + "/v1/completions", json=long) as queued:
                        assert queued.status_code == 200
                        assert wait_until(lambda: engine.num_streams == 2, timeout_s=5)
                        error = error_of(post(url, "/v1/completions", json=long), 429)
                        assert "--max-waiting-requests 1" in error["message"]
            assert wait_until(lambda: engine.engine.pool.allocator.num_used == 0)
    finally:
        engine.shutdown()
