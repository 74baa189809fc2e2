"""Faults a hostile or careless client found: disconnects, bursts, huge prompts, cut streams,
slow headers, loose types; each through the real server on a loopback port."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.harness import (
    ServerProcess,
    need_tokenizer,
    running_app,
    tiny_engine,
    wait_until,
)

LONG = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
# Some faults here need bodies past the default cap (4 MiB) to show the guards behind it.
LARGE_BODY_CAP = 16 * 1024 * 1024


def _metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", trust_env=False, timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.timeout(180)
def test_a_plain_request_whose_socket_closes_leaves_no_traceback_and_is_freed(tmp_path):
    """A client whose socket closes under a plain (not streamed) request: the request is
    aborted and freed, and the server's log holds no traceback. Slow (about 8 s): the log is
    a `bullet serve` process's own."""
    need_tokenizer()
    server = ServerProcess(["--load-format", "dummy", "--model", "tiny"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        body = json.dumps({**LONG, "stream": False}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        running = "bullet:num_requests_running"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head + body)
            assert wait_until(lambda: _metric(server.url, running) == 1.0, timeout_s=20)
        assert wait_until(lambda: _metric(server.url, running) == 0.0, timeout_s=20)
        assert _metric(server.url, "bullet:kv_cache_blocks_used") == 0.0
        assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
        log = server.log()
        assert "Traceback" not in log and "InvalidStateError" not in log, log
    finally:
        server.stop()


async def _burst(url: str, count: int) -> list[httpx.Response]:
    """`count` streamed completions sent at once; each response once its status is known,
    the accepted ones kept open until all have answered."""
    body = {**LONG, "stream": True}
    async with httpx.AsyncClient(
        trust_env=False, timeout=60, limits=httpx.Limits(max_connections=count)
    ) as client:
        answered: list[httpx.Response] = []
        all_answered = asyncio.Event()

        async def one() -> None:
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                answered.append(response)
                if len(answered) == count:
                    all_answered.set()
                await asyncio.wait_for(all_answered.wait(), timeout=60)

        await asyncio.gather(*(one() for _ in range(count)))
        return answered


def test_a_burst_never_leaves_more_waiting_than_the_cap():
    engine = tiny_engine(max_num_seqs=8)
    real_execute = engine.engine.runner.execute

    def slowed(works, out=None):  # so that no accepted request ends while the burst comes in
        time.sleep(0.02)
        return real_execute(works, out)

    engine.engine.runner.execute = slowed
    waiting_seen: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            waiting_seen.append(len(engine.engine.waiting))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with running_app(engine, max_waiting_requests=8) as url:
            responses = asyncio.run(_burst(url, 64))
            statuses = [r.status_code for r in responses]
            accepted = statuses.count(200)
            # 8 run and at most 8 wait; every other request is told to come back later.
            assert 8 <= accepted <= 16, statuses
            assert statuses.count(429) == 64 - accepted, statuses
            assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
            assert wait_until(lambda: engine.engine.pool.allocator.num_used == 0, timeout_s=20)
    finally:
        sampling.set()
        sampler.join(5)
        engine.shutdown()
    assert max(waiting_seen) <= 8


def test_health_answers_while_a_two_million_token_prompt_is_rejected():
    engine = tiny_engine()
    try:
        with running_app(engine, max_request_bytes=LARGE_BODY_CAP) as url:
            outcome: list[httpx.Response] = []
            prompt = "hello " * 2_000_000  # 12 MB, under the raised body cap
            sender = threading.Thread(
                target=lambda: outcome.append(
                    httpx.post(
                        url + "/v1/completions",
                        json={"prompt": prompt, "max_tokens": 4},
                        trust_env=False,
                        timeout=60,
                    )
                )
            )
            slowest = 0.0
            sender.start()
            with httpx.Client(trust_env=False, timeout=10) as client:
                while sender.is_alive():
                    start = time.perf_counter()
                    assert client.get(url + "/health").status_code == 200
                    slowest = max(slowest, time.perf_counter() - start)
                    time.sleep(0.01)
            sender.join()
            assert outcome[0].status_code == 400, outcome[0].text
            assert outcome[0].json()["error"]["param"] == "prompt"
            assert slowest < 0.25, slowest  # /health's bound under any one request
    finally:
        engine.shutdown()


def test_partial_headers_are_timed_out():
    engine = tiny_engine()
    try:
        with running_app(engine, header_timeout_s=0.5) as url:
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                start = time.monotonic()
                assert sock.recv(1024) == b""  # closed by the server, not by the 10 s timeout
                assert time.monotonic() - start < 5
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
    finally:
        engine.shutdown()


def test_a_chat_body_past_the_structure_bounds_is_refused_before_it_stalls_the_server(url):
    """400,000 empty messages (13 MB, under the body limit) held the event loop 1.9 s while
    pydantic validated them, the GIL held throughout: /health waited as long. The structure is
    now counted first (a 400 naming the field); the loop's work is then parsing the JSON."""
    huge = json.dumps({"messages": [{"role": "user", "content": ""}] * 400_000}).encode()
    outcome = {}

    def send() -> None:
        headers = {"content-type": "application/json"}
        outcome["response"] = httpx.post(
            url + "/v1/chat/completions", content=huge, headers=headers, trust_env=False, timeout=60
        )

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    with httpx.Client(trust_env=False, timeout=30) as client:
        for _ in range(2000):  # bounded: the request ends in well under a second
            if not sender.is_alive():
                break
            start = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.01)
    sender.join(60)
    error = outcome["response"].json()["error"]
    assert outcome["response"].status_code == 400 and error["param"] == "messages"
    assert slowest < 1.0  # a liveness bound with room for a slow machine (1.9 s before)
    parts = [{"type": "text", "text": ""}] * 20_000
    body = {"messages": [{"role": "user", "content": parts}]}
    response = httpx.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool] * 2000}
    response = httpx.post(url + "/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_a_stalled_body_is_answered_408_and_its_connection_closed():
    """Headers complete, the body stalled: without a deadline of its own the connection was
    held for 45 s or more."""
    engine = tiny_engine()
    try:
        with running_app(engine, body_timeout_s=0.5) as url:
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                    b'{"prompt": "hel'
                )
                start = time.monotonic()
                answer = b""
                while chunk := sock.recv(4096):  # until the server closes the connection
                    answer += chunk
                assert time.monotonic() - start < 5
            assert answer.startswith(b"HTTP/1.1 408")
            assert b'"code":408' in answer
            body = {"prompt": "hello", "max_tokens": 2}
            response = httpx.post(url + "/v1/completions", json=body, trust_env=False)
            assert response.status_code == 200
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def url():
    engine = tiny_engine()
    with running_app(engine, max_request_bytes=LARGE_BODY_CAP) as base_url:
        yield base_url
    engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ],
    ids=["stream-as-string", "max-tokens-as-string", "unknown-role"],
)
def test_loosely_typed_fields_are_400_as_openai_answers(url, path, body, param):
    response = httpx.post(url + path, json=body, trust_env=False, timeout=30)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["param"]


def test_metrics_also_carry_vllms_names(url):
    httpx.post(
        url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, trust_env=False, timeout=30
    )
    text = httpx.get(url + "/metrics", trust_env=False).text
    for name in (
        'vllm:num_requests_running{model_name="tiny"}',
        'vllm:prompt_tokens_total{model_name="tiny"}',
        'vllm:time_to_first_token_seconds_count{model_name="tiny"}',
    ):
        assert name in text
    assert 'bullet:num_requests_running{model_name="tiny"}' in text
