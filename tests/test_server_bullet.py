"""The server on the two-lane engine: concurrent streams finish, /metrics shows the split."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai

from tests.server.harness import running_app, tiny_engine, wait_until


def _metric_lines(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", trust_env=False).text
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels] = float(value)
    return found


def test_bullet_server_streams_and_reports_lane_units():
    engine = tiny_engine(policy="bullet", max_model_len=512, prefill_layers_per_step=1)
    try:
        with running_app(engine) as url:
            http = httpx.Client(trust_env=False, timeout=120)
            client = openai.OpenAI(
                base_url=url + "/v1", api_key="x", max_retries=0, http_client=http
            )

            def stream(index: int) -> int:
                chunks = client.completions.create(
                    model="tiny",
                    prompt=f"request number {index} " * (1 + index % 5),
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                return sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].text)

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                counts = list(pool.map(stream, range(16)))
            assert all(count > 0 for count in counts)
            units = _metric_lines(url, "bullet:lane_units")
            assert {k.split('lane="')[1].split('"')[0] for k in units} == {"prefill", "decode"}
            assert all(0 <= v <= engine.engine.executor.units.total for v in units.values())
            assert _metric_lines(url, "bullet:step_prediction_error")

            def drained() -> bool:
                used = _metric_lines(url, "bullet:kv_cache_blocks_used")
                running = _metric_lines(url, "bullet:num_requests_running")
                return list(used.values()) == [0.0] and list(running.values()) == [0.0]

            assert wait_until(drained, timeout_s=10)
            http.close()
    finally:
        engine.shutdown()
