"""Hardening, round three: one request never takes the server down, and nothing a client sends
is compiled, held or parsed without a bound. Each through the real server on a loopback port."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.harness import running_app, tiny_engine

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
