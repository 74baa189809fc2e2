"""Prefix caching end to end on a tiny random model (fp32): the same greedy tokens with the
cache on and off under every policy and under lanes, hits counted, no block leaked."""

from __future__ import annotations

import random

import pytest

from bulletserve import LLM, SamplingParams
from tests.tiny_models import TINY_LLAMA_BLOCK_BYTES, TINY_VOCAB

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Three system prompts of 37-53 tokens, each shared by four requests with their own
    questions, and one prompt sent twice."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(37, 53))] for _ in "abc"]
    prompts = [
        system + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 20))]
        for system in systems
        for _ in range(4)
    ]
    return prompts + [prompts[0]]


SETTINGS = {
    "chunked": {"policy": "chunked"},
    "chunked-16": {"policy": "chunked", "chunked_prefill_size": 16},
    "prefill-first": {"policy": "prefill-first"},
    "bullet": {"policy": "bullet", "num_threads": 2},
    "bullet-layer-groups": {"policy": "bullet", "num_threads": 2, "prefill_layers_per_step": 1},
    "chunked-preempting": {
        "policy": "chunked",
        "kv_cache_memory": str(24 * TINY_LLAMA_BLOCK_BYTES),
    },
}


def _generate(model_dir, caching: bool, settings: dict) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=caching,
        **settings,
    )
    prompts = shared_prefix_prompts(seed=3)
    # Twice: the second round finds every system prompt cached by the first.
    tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    tokens += [o.token_ids for o in llm.generate(prompts, GREEDY)]
    return tokens, llm


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_tokens_are_the_same_with_the_cache_on_and_off(tiny_llama_dir, name):
    expected, plain = _generate(tiny_llama_dir, False, SETTINGS[name])
    assert plain.engine.book.prefix_queries == 0
    tokens, llm = _generate(tiny_llama_dir, True, SETTINGS[name])
    try:
        assert tokens == expected
        book = llm.engine.book
        assert book.prefix_hits >= 3 * 32  # at least each system prompt's full blocks, once
        assert llm.engine.pool.allocator.num_used == 0  # cached blocks count as free
        assert llm.engine.pool.allocator.num_cached > 0
    finally:
        for engine in (plain.engine, llm.engine):
            close = getattr(engine, "close", None)
            if close is not None:
                close()


def test_outputs_report_their_cached_prompt_tokens(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    prompt = shared_prefix_prompts(seed=4)[0]
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("policy", ["chunked", "bullet"])
def test_only_requests_with_the_same_cache_salt_share_cached_blocks(tiny_llama_dir, policy):
    """vLLM's cache_salt: without it a client that guesses another's prompt learns it was sent
    (its cached tokens, a sooner first token); with salts, only requests of one salt share."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, policy=policy)
    prompt = shared_prefix_prompts(seed=4)[0]

    def cached(salt: str | None) -> int:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, cache_salt=salt)
        return llm.generate([prompt], params)[0].num_cached_tokens

    try:
        assert cached("alice") == 0
        assert cached(None) == 0  # the unsalted cache knows nothing of alice's prompt
        assert cached("bob") == 0
        assert cached("alice") > 0 and cached("bob") > 0 and cached(None) > 0
        # Salted blocks are cached blocks like any: nothing leaks when the requests end.
        assert llm.engine.book.allocator.num_used == 0
    finally:
        llm.engine.close()
