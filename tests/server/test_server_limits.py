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
            # The first compile waits for the compiler process to start: 3 s alone, and more
            # than httpx's default 5 s of patience on a busy machine.
            response = httpx.post(url + "/v1/completions", json=warm, trust_env=False, timeout=60)
            assert response.status_code == 200, response.text
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
            # The first compile also waits for the compiler process to start (seconds, more
            # beside another worker's tests).
            for _ in range(10):
                response = httpx.post(
                    url + "/v1/completions", json=warm, trust_env=False, timeout=60
                )
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
    """SIGTERM while grammars compile: the server ends within its 4 s shutdown timeout. Slow
    (about 12 s): a `bullet serve` process, its compiler process, and the timeout itself."""
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


DEEP = "__deep__"
LARGE_BODY_CAP = 16 * 1024 * 1024


@pytest.mark.timeout(180)
def test_a_body_nested_nearly_as_deep_as_json_allows_is_a_400_not_a_500():
    engine = tiny_engine(max_model_len=256)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"a": DEEP}}}
    bodies = [
        ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"deep": DEEP}}),
        ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}),
        ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "none"}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "guided_json": {"enum": [DEEP]}}),
    ]
    try:
        with running_app(engine) as url:
            for depth in (100, 200, 850, 900, 930, 965, 990):
                for path, body in bodies:
                    # Written as text: Python's own JSON encoder stops short of these depths.
                    nested = "[" * depth + "]" * depth
                    text = json.dumps(body).replace(f'"{DEEP}"', nested)
                    response = httpx.post(
                        url + path,
                        content=text,
                        headers={"Content-Type": "application/json"},
                        trust_env=False,
                        timeout=60,
                    )
                    allowed = (200, 400) if depth <= 100 else (400,)
                    assert response.status_code in allowed, (depth, path, response.text)
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
    finally:
        engine.shutdown()


class _HealthProbe:
    """/health asked every 20 ms from a thread; the slowest answer while it ran."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(trust_env=False, timeout=30) as client:
            for _ in range(10_000):
                if self._stop.is_set():
                    return
                started = time.monotonic()
                client.get(self.url + "/health")
                self.worst_s = max(self.worst_s, time.monotonic() - started)
                time.sleep(0.02)

    def __enter__(self) -> _HealthProbe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, trust_env=False, timeout=120)


@pytest.mark.timeout(300)
def test_list_fields_are_bounded_before_they_are_walked():
    engine = tiny_engine(max_model_len=256)
    try:
        # The body cap raised past its default (4 MiB), to show the bounds behind it.
        with running_app(engine, max_request_bytes=LARGE_BODY_CAP) as url:
            base = {"prompt": "Hi", "max_tokens": 2}
            refused = [
                ("logit_bias", {**base, "logit_bias": {str(i): 1 for i in range(1025)}}),
                ("allowed_token_ids", {**base, "allowed_token_ids": [1] * 262_145}),
                ("bad_words", {**base, "bad_words": ["w"] * 1025}),
                ("stop", {**base, "stop": ["s"] * 257}),
                ("stop_token_ids", {**base, "stop_token_ids": [1] * 1025}),
                ("prompt", {**base, "prompt": [1] * (1 << 20 | 1)}),
                ("prompt", {**base, "prompt": [[1] * (1 << 19)] * 3}),
            ]
            for field, body in refused:
                response = _post(url, "/v1/completions", body)
                assert response.status_code == 400, (field, response.text[:300])
                assert response.json()["error"]["param"] == field
            response = _post(url, "/detokenize", {"tokens": [1] * (1 << 20 | 1)})
            assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    finally:
        engine.shutdown()


@pytest.mark.timeout(300)
def test_heavy_per_request_work_stays_off_the_event_loop():
    engine = tiny_engine(max_model_len=2048)
    try:
        with running_app(engine, max_request_bytes=LARGE_BODY_CAP) as url:
            long_prompt = {"prompt": "Once upon a time " * 400, "max_tokens": 2}
            probes = [
                ("/v1/completions", {**long_prompt, "bad_words": [f"w{i}" for i in range(1024)]}),
                ("/detokenize", {"tokens": [100 + i % 1000 for i in range(1 << 20)]}),
                ("/v1/completions", {**long_prompt, "prompt_logprobs": 20}),
                ("/v1/completions", {**long_prompt, "echo": True, "logprobs": 20, "stream": True}),
            ]
            for path, body in probes:
                _post(url, path, {**body, **({"tokens": [1]} if path == "/detokenize" else {})})
                with _HealthProbe(url) as probe:
                    response = _post(url, path, body)
                assert response.status_code == 200, response.text[:300]
                # A regression guard, far above what it measures (docs/api.md has the figures).
                assert probe.worst_s < 1.0, (path, list(body)[-1], probe.worst_s)
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_continuous_usage_stats_put_usage_in_every_chunk():
    engine = tiny_engine(max_model_len=256)
    try:
        with running_app(engine) as url:
            for path, start in (
                ("/v1/completions", {"prompt": "Once upon a time"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            ):
                body = {
                    **start,
                    "max_tokens": 5,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                }
                with httpx.stream("POST", url + path, json=body, trust_env=False) as response:
                    chunks = [
                        json.loads(line[6:])
                        for line in response.iter_lines()
                        if line.startswith("data: {")
                    ]
                assert chunks and all(c["usage"] is not None for c in chunks), chunks
                completions = [c["usage"]["completion_tokens"] for c in chunks]
                assert completions == sorted(completions) and completions[-1] == 5, completions
                prompt = chunks[-1]["usage"]["prompt_tokens"]
                assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
                assert not chunks[-1]["choices"]  # the final usage chunk, as without it
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_logit_bias_keys_are_ascii_digits_and_a_tiny_repetition_penalty_keeps_logprobs():
    engine = tiny_engine(max_model_len=256)
    try:
        with running_app(engine) as url:
            for key in ("\u00b2", "\u0661\u0662", "-1", "1.0", " 1"):
                body = {"prompt": "Hi", "max_tokens": 2, "logit_bias": {key: 5}}
                response = _post(url, "/v1/completions", body)
                assert response.status_code == 400, (key, response.text)
                assert response.json()["error"]["param"] == "logit_bias"
            body = {"prompt": "Hi there", "max_tokens": 4, "repetition_penalty": 1e-300,
                    "logprobs": 2, "ignore_eos": True}  # fmt: skip
            response = _post(url, "/v1/completions", body)
            assert response.status_code == 200, response.text
            logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert len(logprobs) == 4 and all(isinstance(lp, float) for lp in logprobs), logprobs
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_a_body_past_the_default_cap_is_a_413_before_it_is_parsed():
    engine = tiny_engine(max_model_len=256)
    try:
        with running_app(engine) as url:
            body = {
                "prompt": "Hi",
                "max_tokens": 2,
                "logit_bias": {str(i): 1 for i in range(800_000)},
            }
            with _HealthProbe(url) as probe:
                response = _post(url, "/v1/completions", body)
            assert response.status_code == 413, response.text[:300]
            assert probe.worst_s < 1.0, probe.worst_s
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_constraints_that_leave_no_token_are_a_400_not_an_empty_200():
    engine = tiny_engine(max_model_len=256)
    try:
        with running_app(engine) as url:
            tokenizer = engine.front.tokenizer
            digit = tokenizer.encode("7", add_special_tokens=False)
            body = {"prompt": "Yes or no?", "max_tokens": 4, "guided_choice": ["yes", "no"],
                    "allowed_token_ids": digit}  # fmt: skip
            response = _post(url, "/v1/completions", body)
            assert response.status_code == 400, response.text
            assert "leave no token" in response.json()["error"]["message"]
            with httpx.stream(
                "POST", url + "/v1/completions", json={**body, "stream": True}, trust_env=False
            ) as stream:
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert '"code":400' in events[-2] and events[-1] == "data: [DONE]", events
            bad = {"prompt": "Hi", "max_tokens": 4, "allowed_token_ids": digit,
                   "bad_words": ["7"]}  # fmt: skip
            assert _post(url, "/v1/completions", bad).status_code == 400
            ok = {"prompt": "Yes or no?", "max_tokens": 4, "guided_choice": ["yes", "no"]}
            assert _post(url, "/v1/completions", ok).status_code == 200
            assert wait_until(lambda: engine.engine.pool.allocator.num_used == 0, timeout_s=10)
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["chunked", "bullet"])
def test_a_fault_in_one_requests_handling_fails_that_request_alone(policy, monkeypatch):
    """A fault injected where a request's token is handled (its grammar, here) fails that
    request with a 500 whose details go to the log; the engine and other requests go on."""
    from bulletserve.engine.structured import GrammarState

    def broken(self, token: int) -> bool:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(GrammarState, "accept", broken)
    engine = tiny_engine(policy=policy, max_model_len=256)
    try:
        with running_app(engine) as url:
            faulty = {"prompt": "Hi", "max_tokens": 4, "guided_regex": "[a-z]+"}
            response = _post(url, "/v1/completions", faulty)
            assert response.status_code == 500, response.text
            assert "error id" in response.json()["error"]["message"]
            with httpx.stream(
                "POST", url + "/v1/completions", json={**faulty, "stream": True}, trust_env=False
            ) as stream:
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert '"code":500' in events[-2] and events[-1] == "data: [DONE]", events
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
            plain = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
            assert plain.status_code == 200, plain.text
            assert wait_until(lambda: engine.engine.pool.allocator.num_used == 0, timeout_s=10)
    finally:
        engine.shutdown()
