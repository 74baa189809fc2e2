"""The official `openai` client against an in-process server on the tiny random model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.harness import running_app, tiny_engine, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog and"
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with running_app(engine) as base_url:
        yield base_url


@pytest.fixture
def client(url):
    http = httpx.Client(trust_env=False, timeout=60)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
    http.close()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", trust_env=False).text
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, f"{name} not in /metrics"
    return float(lines[0].rsplit(" ", 1)[1])


def counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].owned_by == "bulletserve"
    assert models[0].model_extra["max_model_len"] == engine.engine.max_model_len


def test_completion_usage_counts_the_tokenizers_prompt_and_the_output(client, engine):
    result = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    usage = result.usage
    assert usage.prompt_tokens == len(engine.engine.tokenizer.encode(PROMPT))
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].text


def test_streamed_completion_matches_the_plain_one(client):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    plain = client.completions.create(**args, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and counts(chunks[-1].usage) == counts(plain.usage)


def test_prompt_as_token_ids_and_as_a_list_of_one_string(client, engine):
    ids = engine.engine.tokenizer.encode(PROMPT)
    args = dict(model="tiny", max_tokens=6, temperature=0)
    by_text = client.completions.create(prompt=PROMPT, **args).choices[0].text
    assert client.completions.create(prompt=ids, **args).choices[0].text == by_text
    assert client.completions.create(prompt=[PROMPT], **args).choices[0].text == by_text


def test_chat_plain_and_streamed(client):
    args = dict(model="tiny", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**args, max_completion_tokens=8)
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == 8
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 8
    chunks = list(
        client.chat.completions.create(
            **args, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert counts(chunks[-1].usage) == counts(plain.usage)
    # The same prompt again: its full blocks come from the prefix cache.
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == (plain.usage.prompt_tokens - 1) // 16 * 16


def test_stop_string_cuts_the_text_before_it(client):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    result = client.completions.create(**args, stop=[stop, "never-there"])
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**args, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_a_seed_reproduces_a_sampled_completion(client):
    def sample(seed: int) -> str:
        result = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return result.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_logprobs_on_both_endpoints(client):
    result = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == result.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: each chosen token is the most likely one.
    assert all(c.logprob >= c.top_logprobs[0].logprob - 1e-4 for c in content)


def test_max_tokens_defaults_to_the_rest_of_the_context(url, engine):
    engine_len = engine.engine.max_model_len
    prompt = [7] * (engine_len - 3)
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    result = httpx.post(url + "/v1/completions", json=body, trust_env=False, timeout=60).json()
    assert result["usage"]["completion_tokens"] == 3
    assert result["choices"][0]["finish_reason"] == "length"


def test_64_concurrent_streams_finish_and_leave_nothing_running(url, engine):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model="tiny", prompt=f"{PROMPT} {i}", max_tokens=8 + i % 8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens, 8 + i % 8

    async def all_of_them() -> list[tuple[int, int]]:
        http = httpx.AsyncClient(trust_env=False, timeout=120)
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http
        )
        async with http:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(64))), timeout=120
            )

    results = asyncio.run(all_of_them())
    assert all(got == wanted for got, wanted in results)
    assert wait_until(lambda: metric(url, "bullet:num_requests_running") == 0)
    assert metric(url, "bullet:num_requests_waiting") == 0
    assert metric(url, "bullet:kv_cache_blocks_used") == 0
    assert engine.engine.pool.allocator.num_used == 0
    assert metric(url, "bullet:time_to_first_token_seconds_count") >= 64
    assert metric(url, "bullet:generation_tokens_total") >= sum(w for _, w in results)


def test_disconnecting_streams_are_aborted_and_free_their_blocks(url, engine):
    body = {"prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    clients = [httpx.Client(trust_env=False, timeout=30) for _ in range(4)]
    streams = [c.stream("POST", url + "/v1/completions", json=body) for c in clients]
    for stream in streams:
        response = stream.__enter__()
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines, strict=False) if line) >= 3
    assert engine.engine.pool.allocator.num_used > 0
    for stream, client in zip(streams, clients, strict=True):
        stream.__exit__(None, None, None)
        client.close()
    assert wait_until(lambda: engine.engine.pool.allocator.num_used == 0, timeout_s=5)
    assert wait_until(lambda: not engine.engine.running, timeout_s=5)


def test_a_plain_request_whose_client_leaves_is_aborted(url, engine):
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, trust_env=False, timeout=1.0)
    assert wait_until(lambda: engine.engine.pool.allocator.num_used == 0, timeout_s=5)
    assert wait_until(lambda: not engine.engine.running, timeout_s=5)


def test_health_and_version(url):
    assert httpx.get(url + "/health", trust_env=False).status_code == 200
    assert httpx.get(url + "/version", trust_env=False).json()["version"]


def test_a_resent_prompt_reports_cached_tokens_and_the_cache_metrics_count_them(client, url):
    prompt = " ".join(f"word{i}" for i in range(60))  # well over one 16-token block
    args = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    hits = metric(url, "bullet:prefix_cache_hits_total")
    queries = metric(url, "bullet:prefix_cache_queries_total")
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert cached == (again.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert again.choices[0].text == first.choices[0].text
    assert metric(url, "bullet:prefix_cache_hits_total") == hits + cached
    assert (
        metric(url, "bullet:prefix_cache_queries_total") == queries + 2 * again.usage.prompt_tokens
    )
    assert metric(url, "vllm:prefix_cache_hits_total") == hits + cached
