"""Hardening, round three: one request never takes the server down, and nothing a client sends
is compiled, held or parsed without a bound. Each through the real server on a loopback port."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import deque

import httpx
import psutil
import pytest

from tests.server.harness import (
    ServerProcess,
    need_tokenizer,
    running_app,
    tiny_engine,
    wait_until,
)

# Every numeric field a generation request takes, at the values a hostile client tries first.
EXTREMES: list[object] = [0, -1, 5e-324, 1e-300, 1e308, -1e308, 2**64, float("nan"), float("inf")]
NUMERIC_FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "best_of",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "priority",
    "logprobs",
]
SLO_FIELDS = ["ttft_per_token_ms", "tpot_ms", "ttft_base_ms"]


def _bodies() -> list[tuple[str, dict]]:
    base = {"prompt": "Once upon a time", "max_tokens": 2}
    bodies = []
    for value in EXTREMES:
        for name in NUMERIC_FIELDS:
            bodies.append((f"{name}={value}", {**base, name: value}))
        for name in SLO_FIELDS:
            slo = {"ttft_per_token_ms": 5.0, "tpot_ms": 100.0, name: value}
            bodies.append((f"slo.{name}={value}", {**base, "slo": slo}))
        bodies.append((f"logit_bias={value}", {**base, "logit_bias": {"42": value}}))
        bodies.append((f"stop_token_ids={value}", {**base, "stop_token_ids": [value]}))
        bodies.append((f"allowed_token_ids={value}", {**base, "allowed_token_ids": [value]}))
    return bodies


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "bullet"])
def test_every_numeric_field_at_its_extremes_is_served_or_refused_and_the_server_lives(policy):
    engine = tiny_engine(policy=policy, scheduling_policy="priority", max_model_len=256)
    try:
        with running_app(engine, scheduling_policy="priority") as url:
            with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
                for name, body in _bodies():
                    # NaN and Infinity as JSON's common extension (Python's json writes them).
                    response = client.post(
                        "/v1/completions",
                        content=json.dumps(body),
                        headers={"Content-Type": "application/json"},
                    )
                    assert response.status_code in (200, 400), (name, response.text)
                    if response.status_code == 400:
                        assert response.json()["error"]["param"], (name, response.text)
                    assert client.get("/health").status_code == 200, name
                plain = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
                assert plain.status_code == 200, plain.text
        assert engine.engine.pool.allocator.num_used == 0
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_an_slo_target_that_underflows_to_zero_seconds_is_a_400_under_bullet():
    engine = tiny_engine(policy="bullet", max_model_len=256)
    try:
        with running_app(engine) as url:
            for slo in (
                {"ttft_per_token_ms": 5e-324, "tpot_ms": 100},
                {"ttft_per_token_ms": 5, "tpot_ms": 5e-324},
            ):
                body = {"prompt": "Once upon a time", "max_tokens": 4, "slo": slo}
                response = httpx.post(url + "/v1/completions", json=body, trust_env=False)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "slo"
                assert "0.001" in response.json()["error"]["message"]
            ok = {"prompt": "Hi", "max_tokens": 4, "slo": {"ttft_per_token_ms": 1e-3, "tpot_ms": 1}}
            assert httpx.post(url + "/v1/completions", json=ok, trust_env=False).status_code == 200
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
    finally:
        engine.shutdown()


UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


def _schema_bodies() -> list[tuple[str, str, dict]]:
    """(the endpoint, the field that carries the schema, a body asking for UNIQUE there)."""
    chat = {"messages": [{"role": "user", "content": "Numbers?"}], "max_tokens": 8}
    tool = {"type": "function", "function": {"name": "pick", "parameters": UNIQUE}}
    return [
        (
            "/v1/chat/completions",
            "response_format",
            {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": UNIQUE}}},
        ),
        ("/v1/completions", "guided_json", {"prompt": "Numbers:", "guided_json": UNIQUE}),
        (
            "/v1/completions",
            "structured_outputs.json",
            {"prompt": "Numbers:", "structured_outputs": {"json": UNIQUE}},
        ),
        (
            "/v1/chat/completions",
            "tool_choice",
            {
                **chat,
                "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "pick"}},
            },
        ),
        (
            "/v1/chat/completions",
            "tool_choice",
            {**chat, "tools": [tool], "tool_choice": "required"},
        ),
    ]


@pytest.mark.timeout(180)
def test_a_schema_keyword_not_enforced_is_a_400_naming_it_wherever_a_schema_is_taken():
    engine = tiny_engine(max_model_len=256)
    try:
        with running_app(engine) as url:
            for path, field, body in _schema_bodies():
                response = httpx.post(url + path, json=body, trust_env=False, timeout=60)
                assert response.status_code == 400, (field, response.text)
                error = response.json()["error"]
                assert error["param"] == field, error
                assert "'uniqueItems'" in error["message"], error
            allowed = {"prompt": "Numbers:", "max_tokens": 8, "guided_json": {"type": "integer"}}
            response = httpx.post(
                url + "/v1/completions", json=allowed, trust_env=False, timeout=60
            )
            assert response.status_code == 200, response.text
    finally:
        engine.shutdown()


SLOW_GRAMMAR = "root ::= " + " ".join(["[a-z]*"] * 3000)  # about 34 s to compile on one core


def _grammar_workers() -> list[psutil.Process]:
    children = psutil.Process().children(recursive=True)
    return [p for p in children if "grammar_worker" in " ".join(p.cmdline())]


@pytest.mark.timeout(240)
def test_clients_that_leave_during_their_compile_free_their_slots_and_the_cores_at_once():
    engine = tiny_engine(max_model_len=256, grammar_compile_timeout=60.0)
    try:
        with running_app(engine, max_waiting_requests=2) as url:
            warm = {"prompt": "Hi", "max_tokens": 2, "guided_regex": "[a-z]+"}
            assert (
                httpx.post(url + "/v1/completions", json=warm, trust_env=False).status_code == 200
            )
            (worker,) = _grammar_workers()
            slow = {"prompt": "Hi", "max_tokens": 2, "guided_grammar": SLOW_GRAMMAR}
            for _ in range(2):  # both waiting slots, each client gone after 1 s
                with pytest.raises(httpx.TimeoutException):
                    httpx.post(url + "/v1/completions", json=slow, trust_env=False, timeout=1.0)
            started = time.monotonic()
            plain = {"prompt": "Hi", "max_tokens": 2}
            response = httpx.post(url + "/v1/completions", json=plain, trust_env=False, timeout=30)
            assert response.status_code == 200, response.text
            assert time.monotonic() - started < 5.0
            assert wait_until(lambda: not worker.is_running(), timeout_s=5)
            assert wait_until(lambda: engine.front.grammars._pool._jobs == deque(), timeout_s=5)
    finally:
        engine.shutdown()


@pytest.mark.timeout(240)
def test_a_grammar_past_the_deadline_is_a_400_and_the_server_serves_on():
    engine = tiny_engine(max_model_len=256, grammar_compile_timeout=1.5)
    try:
        with running_app(engine) as url:
            warm = {"prompt": "Hi", "max_tokens": 2, "guided_regex": "[a-z]+"}
            # The first compile also waits for the compiler process to start.
            for _ in range(10):
                response = httpx.post(url + "/v1/completions", json=warm, trust_env=False)
                if response.status_code == 200:
                    break
            assert response.status_code == 200, response.text
            slow = {"prompt": "Hi", "max_tokens": 2, "guided_grammar": SLOW_GRAMMAR}
            started = time.monotonic()
            response = httpx.post(url + "/v1/completions", json=slow, trust_env=False, timeout=30)
            assert response.status_code == 400, response.text
            assert "--grammar-compile-timeout" in response.json()["error"]["message"]
            assert response.json()["error"]["param"] == "guided_grammar"
            assert time.monotonic() - started < 5.0
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
    finally:
        engine.shutdown()


@pytest.mark.timeout(240)
def test_sigterm_stops_the_server_within_its_timeout_with_compiles_in_flight(tmp_path):
    need_tokenizer()
    server = ServerProcess(
        [
            "--load-format",
            "dummy",
            "--model",
            "tiny",
            "--grammar-compile-timeout",
            "120",
            "--shutdown-timeout",
            "4",
        ],  # fmt: skip
        tmp_path / "serve.log",
    )
    try:
        server.wait_ready()
        slow = {"prompt": "Hi", "max_tokens": 2, "guided_grammar": SLOW_GRAMMAR}

        def send() -> None:
            try:
                httpx.post(server.url + "/v1/completions", json=slow, trust_env=False, timeout=60)
            except httpx.HTTPError:
                pass

        senders = [threading.Thread(target=send) for _ in range(3)]
        for sender in senders:
            sender.start()
        parent = psutil.Process(server.process.pid)

        def compiling() -> bool:
            workers = [
                p
                for p in parent.children(recursive=True)
                if "grammar_worker" in " ".join(p.cmdline())
            ]
            return any(p.cpu_percent(0.1) > 50 for p in workers)

        assert wait_until(compiling, timeout_s=60)
        workers = parent.children(recursive=True)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)
        assert time.monotonic() - started < 4 + 5  # the engine's own shutdown after it
        assert wait_until(lambda: not any(p.is_running() for p in workers), timeout_s=5)
        for sender in senders:
            sender.join(60)
    finally:
        server.stop()
