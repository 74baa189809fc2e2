"""Two data-parallel replicas on a local Ray instance behind one server: requests spread over
both, a shared prefix stays on one, streaming works through the router, and the death of one
replica is survived by the other; the server exits when none is left."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bulletserve.engine.config import EngineConfig
from tests.server.harness import need_tokenizer, running_app, serving, wait_until

ray = pytest.importorskip("ray")

from bulletserve.replicas.ray_replicas import RayReplicas  # noqa: E402


@pytest.fixture(scope="module")
def replicas():
    """Two replicas on a local Ray instance. Slow (about 18 s): Ray's own start, then two
    actors each loading torch and the model."""
    need_tokenizer()
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False)
    config = EngineConfig(
        model="tiny", load_format="dummy", dtype="float32", kv_cache_memory="64MiB",
        max_model_len=512,
    )  # fmt: skip
    engines = RayReplicas(config, 2)
    try:
        yield engines
    finally:
        engines.shutdown()
        ray.shutdown()


def replica_stats(replicas: RayReplicas) -> list:
    return ray.get([r.actor.stats.remote() for r in replicas._replicas], timeout=30)


def completion(prompt: list[int], max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream,
    }  # fmt: skip


def test_requests_spread_over_both_replicas(replicas):
    before = [s.prefix_cache_queries for s in replica_stats(replicas)]

    async def send_all(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bodies = [completion([100 + i] * 40, max_tokens=8) for i in range(8)]
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=b) for b in bodies)
            )
            return [r.status_code for r in responses]

    with running_app(replicas) as url:
        assert asyncio.run(send_all(url)) == [200] * 8
    after = [s.prefix_cache_queries for s in replica_stats(replicas)]
    looked_up = [a - b for a, b in zip(after, before, strict=True)]
    assert all(tokens >= 40 for tokens in looked_up), looked_up  # each replica served some
    assert sum(looked_up) == 8 * 40


def test_a_shared_prefix_stays_on_one_replica(replicas):
    before = [s.prefix_cache_hits for s in replica_stats(replicas)]
    system = list(range(2000, 2128))
    with running_app(replicas) as url, httpx.Client(base_url=url, timeout=60) as client:
        for question in range(4):
            body = completion(system + [3000 + question] * 5)
            assert client.post("/v1/completions", json=body).status_code == 200
    hits = [s.prefix_cache_hits - b for s, b in zip(replica_stats(replicas), before, strict=True)]
    # The three requests after the first found the 128-token prefix cached where it was sent.
    assert sorted(hits) == [0, 3 * 128]


def test_streaming_through_the_router(replicas):
    with running_app(replicas) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = completion([7] * 20, max_tokens=6, stream=True)
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert len(lines) >= 3
        metrics = client.get("/metrics").text
        assert "bullet:kv_cache_blocks_total" in metrics


def test_a_lora_load_reaches_every_replica(replicas):
    """Each replica's engine answers (these serve no LoRA: their engines started without
    --enable-lora), and the first refusal is the caller's error."""
    with pytest.raises(ValueError, match="--enable-lora"):
        asyncio.run(replicas.load_lora_adapter("late", "/nowhere"))


def test_replicas_the_cluster_cannot_hold_are_refused_at_once(replicas):
    config = EngineConfig(model="tiny", load_format="dummy", num_threads=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="2 replicas of 2 CPUs each need 4 CPUs"):
        RayReplicas(config, 2)


def test_the_death_of_one_replica_is_survived_by_the_other(replicas):
    replicas.kill_replica(0)
    with running_app(replicas) as url, httpx.Client(base_url=url, timeout=60) as client:
        for i in range(4):  # some routed to the dead one before its death is known: re-sent
            body = completion([500 + i] * 30)
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        assert client.get("/health").status_code == 200
    assert wait_until(lambda: not replicas.loads()[0].healthy, timeout_s=10)
    assert replicas.loads()[1].healthy


def test_the_server_exits_when_no_replica_is_left(replicas):
    """The module's last test: it kills every replica. With none left to route to, the server
    shuts down and says why (`bullet serve` then exits non-zero)."""
    with serving(replicas) as (_, server, thread):
        for index in (0, 1):
            replicas.kill_replica(index)
        thread.join(30)
        assert not thread.is_alive()
    assert "every replica has died" in server.engine_failure
