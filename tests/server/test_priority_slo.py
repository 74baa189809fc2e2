"""Per-request priority and SLO targets: vLLM's `priority` under --scheduling-policy priority,
our `slo` field (a class the server was started with, or targets of its own), and the
per-class counters of /metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bulletserve.cli import main
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.factory import create_engine
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.sched.slo import SLO, ServiceClass, parse_slo_class
from tests.server.harness import need_tokenizer, running_app, tiny_engine

BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
CLASSES = {"default": SLO(3.0, 150.0), "interactive": SLO(2.0, 100.0)}


def test_a_priority_needs_priority_scheduling():
    engine = tiny_engine()
    try:
        with running_app(engine) as url:
            reply = httpx.post(f"{url}/v1/completions", json=BODY | {"priority": 1}, timeout=60)
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert (
                error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
            )
            assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200
    finally:
        engine.shutdown()


def test_slo_classes_and_targets_are_served_and_counted_per_class():
    engine = tiny_engine(scheduling_policy="priority")
    try:
        with running_app(engine, scheduling_policy="priority", slo_classes=CLASSES) as url:
            for extra in (
                {"priority": -3, "slo": "interactive"},
                {"slo": {"ttft_per_token_ms": 50, "tpot_ms": 500}},
                {"slo": "default", "priority": 2},
            ):
                reply = httpx.post(f"{url}/v1/completions", json=BODY | extra, timeout=60)
                assert reply.status_code == 200, reply.text
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
            chat |= {"max_tokens": 2, "slo": "interactive"}
            assert (
                httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
            )
            for bad, says in (
                ({"slo": "gold"}, "unknown class 'gold'; this server has default, interactive"),
                ({"slo": {"ttft_per_token_ms": 2}}, "tpot_ms"),
                ({"slo": {"ttft_per_token_ms": 2, "tpot_ms": 9, "ttl": 1}}, "ttl"),
                ({"slo": {"ttft_per_token_ms": -2, "tpot_ms": 9}}, "ttft_per_token_ms"),
            ):
                reply = httpx.post(f"{url}/v1/completions", json=BODY | bad, timeout=60)
                assert reply.status_code == 400 and says in reply.text, reply.text
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        engine.shutdown()
    assert 'bullet:slo_requests_total{model_name="tiny",slo_class="interactive"} 2.0' in metrics
    assert 'bullet:slo_requests_total{model_name="tiny",slo_class="custom"} 1.0' in metrics
    assert 'bullet:slo_requests_total{model_name="tiny",slo_class="default"} 1.0' in metrics
    assert 'bullet:slo_met_total{model_name="tiny",slo_class="custom",target="both"}' in metrics
    assert "bullet:num_requests_waiting_by_slo_class" in metrics


def test_the_queue_runs_by_priority():
    """One request at a time: of three queued together, the lowest priority value runs first;
    among equal priorities the earlier."""
    need_tokenizer()
    engine = create_engine(
        EngineConfig(
            model="tiny", load_format="dummy", scheduling_policy="priority", max_num_seqs=1
        )
    )
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    try:
        for request_id, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
            engine.add_request("Hello", params, request_id, service=ServiceClass(priority))
        finished = []
        for _ in range(100):
            finished += [out.request_id for out in engine.step() if out.finished]
            if not engine.has_unfinished():
                break
    finally:
        engine.close()
    assert finished == ["b", "d", "c", "a"]


def test_a_priority_under_fcfs_is_refused_by_the_engine():
    need_tokenizer()
    engine = create_engine(EngineConfig(model="tiny", load_format="dummy"))
    try:
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            engine.add_request("Hello", SamplingParams(max_tokens=2), service=ServiceClass(1))
    finally:
        engine.close()


def test_slo_class_flags(capsys):
    assert parse_slo_class("chat=2,100") == ("chat", SLO(2.0, 100.0))
    assert parse_slo_class("batch=20,1000,50") == ("batch", SLO(20.0, 1000.0, 50.0))
    for bad in ("chat", "chat=2", "chat=x,1", "chat=0,1", "default=2,100", "=2,100"):
        with pytest.raises(ValueError):
            parse_slo_class(bad)
    need_tokenizer()
    argv = ["serve", "--model", "tiny", "--load-format", "dummy", "--slo-class", "chat=2"]
    assert main(argv) == 2
    assert "--slo-class: expected NAME=TTFT_PER_TOKEN_MS,TPOT_MS" in capsys.readouterr().err


def test_requests_waiting_past_the_queue_delay_are_shed_with_a_429():
    """One request at a time and a 50 ms queue delay: of a burst, the first runs and those
    still waiting for their first step after 50 ms are shed, a 429 (an error event where they
    stream), counted per class."""
    engine = tiny_engine(max_num_seqs=1, max_queue_delay_ms=50.0)
    body = BODY | {"max_tokens": 64, "ignore_eos": True}

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            posts = [client.post(f"{url}/v1/completions", json=body) for _ in range(6)]
            streamed = client.post(f"{url}/v1/completions", json=body | {"stream": True})
            return await asyncio.gather(*posts, streamed)

    try:
        with running_app(engine, slo_classes=CLASSES) as url:
            *replies, streamed = asyncio.run(burst(url))
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        engine.shutdown()
    codes = sorted(r.status_code for r in replies)
    assert codes[0] == 200 and codes[-1] == 429, codes
    shed = next(r for r in replies if r.status_code == 429)
    assert "--max-queue-delay-ms" in shed.json()["error"]["message"]
    assert shed.headers["Retry-After"] == "1"
    assert streamed.status_code == 200 and '"code":429' in streamed.text
    count = codes.count(429) + 1
    assert (
        f'bullet:requests_shed_total{{model_name="tiny",slo_class="default"}} {count}.0' in metrics
    )
