"""Tensor parallelism with two gloo ranks on the CPU: the sharded loader, greedy outputs equal to
one rank's, streaming through the server, and a dead rank failing requests with a clear error."""

from __future__ import annotations

import re
import shutil
import sys
import time

import httpx
import psutil
import pytest
import torch

from bulletserve.dist.parallel import RankFailedError, Shard, TensorParallel
from bulletserve.model.shard import weight_split
from bulletserve.engine.async_engine import AsyncEngine
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.llm import LLM
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.model.config import ModelConfig
from bulletserve.model.loader import load_model
from bulletserve.model.presets import get_preset
from bulletserve.model.source import resolve_model
from tests.server.harness import running_app, serving, wait_until
from tests.tiny_models import make_hf_model, needs_default_model, random_prompts

TP_ARGS = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    """Untied LM head, q/k/v biases: every kind of split."""
    folder = tmp_path_factory.mktemp("tiny-qwen2-tp")
    make_hf_model("qwen2", folder, seed=4, init_std=0.3)
    return folder


def _assert_shards_match(source, whole_model, size=2):
    whole = dict(whole_model.named_parameters())
    for rank in range(size):
        shard = Shard(rank, size)
        model = load_model(
            source, torch.float32, torch.device("cpu"), 256, pack_linear=False,
            tp=TensorParallel(shard),
        )  # fmt: skip
        assert model.shard_config.num_kv_heads == whole_model.config.num_kv_heads // size
        for name, param in model.named_parameters():
            split = weight_split(name, whole_model.config)
            expected = whole[name] if split is None else split.take(whole[name], shard)
            assert torch.equal(param, expected), (rank, name)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_sharded_loader_matches_the_unsharded_weights(fixture, request):
    source = resolve_model(str(request.getfixturevalue(fixture)), "auto")
    whole = load_model(source, torch.float32, torch.device("cpu"), 256, pack_linear=False)
    _assert_shards_match(source, whole)


def test_sharded_dummy_weights_are_the_whole_models():
    source = resolve_model("tiny", "dummy")
    whole = load_model(source, torch.float32, torch.device("cpu"), 256, pack_linear=False)
    _assert_shards_match(source, whole)


@needs_default_model
def test_sharded_gguf_weights_are_the_whole_models():
    """The default model (a GGUF file; 9 heads, 3 KV heads) over 3 ranks."""
    source = resolve_model(None, "auto")
    whole = load_model(source, torch.float32, torch.device("cpu"), 256, pack_linear=False)
    _assert_shards_match(source, whole, size=3)


def test_shards_of_an_uneven_vocabulary_cover_it_once():
    sizes = [Shard(rank, 3).padded_range(49155) for rank in range(3)]
    assert sizes == [(0, 16385), (16385, 32770), (32770, 49155)]
    assert [Shard(rank, 4).padded_range(10) for rank in range(4)] == [
        (0, 3),
        (3, 6),
        (6, 9),
        (9, 10),
    ]


def test_a_size_that_does_not_divide_the_heads_is_refused():
    config: ModelConfig = get_preset("smollm2-135m")  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 does not divide"):
        config.sharded(2)
    assert config.sharded(3).num_kv_heads == 1


@pytest.mark.parametrize(
    "policy,extra",
    [
        ("chunked", {}),
        ("chunked", {"chunked_prefill_size": 32}),
        # Lanes side by side on every rank (a static split, prefills in several passes while
        # the decode lane runs) and prefills in one-layer groups.
        ("bullet", {"partition": "static:1/1", "num_threads": 2, "max_num_batched_tokens": 64}),
        ("bullet", {"prefill_layers_per_step": 1}),
    ],
)
def test_two_ranks_generate_what_one_rank_does(tiny_llama_dir, policy, extra):
    prompts = random_prompts(10, seed=7, low=5, high=70)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for size in (1, 2):
        llm = LLM(str(tiny_llama_dir), policy=policy, tensor_parallel_size=size, **TP_ARGS, **extra)
        try:
            outputs[size] = [out.token_ids for out in llm.generate(prompts, params)]
            assert llm.engine.pool.allocator.num_used == 0
        finally:
            llm.close()
    assert outputs[2] == outputs[1]


@pytest.mark.parametrize("policy", ["chunked", "bullet"])
def test_a_dead_rank_fails_requests_with_a_clear_error(tiny_llama_dir, policy):
    llm = LLM(str(tiny_llama_dir), policy=policy, tensor_parallel_size=2, **TP_ARGS)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        assert len(llm.generate(random_prompts(2, seed=1), params)) == 2
        follower = llm.engine.ranks.processes[1]
        follower.kill()
        follower.wait(10)
        with pytest.raises((RankFailedError, RuntimeError), match="rank 1 exited with code -9"):
            llm.generate(random_prompts(2, seed=2), params)
    finally:
        llm.close()


def test_the_server_streams_from_two_ranks_and_exits_when_one_dies(tiny_llama_dir, caplog):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2, **TP_ARGS))
    try:
        with (
            serving(engine) as (url, server, thread),
            httpx.Client(base_url=url, timeout=60) as client,
        ):
            body = {"model": "tiny", "prompt": "one two three", "max_tokens": 6, "stream": True}
            body.update(temperature=0, ignore_eos=True)
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line.startswith("data: {")]
            assert len(events) >= 2
            engine.engine.ranks.processes[1].kill()
            response = client.post("/v1/completions", json={**body, "stream": False})
            assert response.status_code >= 500
            # The client gets a plain message and an id; the rank's failure (gloo's paths and
            # a peer's address) goes to the server log under that id.
            message = response.json()["error"]["message"]
            error_id = re.search(r"error id (err-[0-9a-f]+)", message).group(1)
            assert "rank" not in message and "gloo" not in message
            logged = [r for r in caplog.records if error_id in r.getMessage()]
            assert logged and "rank 1 exited" in str(logged[0].exc_info[1])
            thread.join(15)  # the server shuts down by itself: a dead rank kills the engine
            assert not thread.is_alive()
            assert "rank 1 exited" in server.engine_failure
    finally:
        engine.shutdown()


def test_two_ranks_serve_bf16_with_their_cpu_gemms_built_at_start(tiny_llama_dir):
    """bf16 on a CPU builds GEMM kernels at start on every rank, and pads a step's rows alike
    on both (their all-reduces meet); partial sums in bf16 differ from one rank's, so only the
    outputs' shape is compared."""
    llm = LLM(
        str(tiny_llama_dir),
        tensor_parallel_size=2,
        dtype="bfloat16",
        kv_cache_memory="64MiB",
        max_model_len=256,
        cpu_warmup_rows=48,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outputs = llm.generate(random_prompts(40, seed=9, low=5, high=40), params)
        assert [len(out.token_ids) for out in outputs] == [6] * 40
        assert llm.engine.pool.allocator.num_used == 0
    finally:
        llm.close()


def test_an_engine_that_fails_to_start_stops_its_other_ranks(tiny_llama_dir):
    with pytest.raises(ValueError, match="the KV pool holds"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", kv_cache_memory="4KiB")
    ranks = [
        child
        for child in psutil.Process().children(recursive=True)
        if "bulletserve.engine.ranks" in " ".join(child.cmdline())
    ]
    assert ranks == []


def test_a_rank_that_cannot_start_fails_the_engine_at_once(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(sys, "executable", shutil.which("false"))  # every other rank exits 1
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 exited with code 1 before joining"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **TP_ARGS)
    assert time.monotonic() - started < 30
