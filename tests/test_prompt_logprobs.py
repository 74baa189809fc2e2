"""Prompt logprobs (vLLM's `prompt_logprobs`): every prompt token's logprob given the tokens
before it, against transformers' forward pass over the whole prompt, under every executor and
with the prompt computed in chunks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulletserve import LLM, SamplingParams
from tests.tiny_models import random_prompts

TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Per prompt, transformers' log-softmax over the vocabulary at every position."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


def _check(prompt: list[int], entries, expected: torch.Tensor) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] is None  # nothing predicts the first token
    for position in range(1, len(prompt)):
        entry, row = entries[position], expected[position - 1]
        token = prompt[position]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=2e-3)
        # The rank, within the logprobs' rounding (a random model's vocabulary is dense there).
        assert int((row > row[token] + 2e-3).sum()) < entry.rank
        assert entry.rank <= int((row > row[token] - 2e-3).sum()) + 1
        assert len(entry.top) == TOP
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        assert entry.top[0][1] == pytest.approx(float(row.max()), abs=2e-3)


@pytest.mark.parametrize(
    "settings",
    [
        {"policy": "chunked"},
        {"policy": "chunked", "chunked_prefill_size": 7},  # prompts in chunks of 7 tokens
        {"policy": "prefill-first"},
        {"policy": "bullet"},
    ],
)
def test_prompt_logprobs_match_a_whole_prompt_forward(tiny_llama_dir, reference, settings):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, **settings)
    try:
        prompts = random_prompts(4, seed=21)
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    for prompt, output in zip(prompts, outputs, strict=True):
        _check(prompt, output.prompt_logprobs, reference(prompt))


def test_a_request_for_prompt_logprobs_computes_its_cached_prefix_again(tiny_llama_dir, reference):
    """A cached prefix has no logits: the request computes every prompt token (vLLM does the
    same), and a later request without them still finds the prefix cached."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        prompt = random_prompts(1, seed=22, low=40)[0]
        plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        asking = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
        llm.generate([prompt], plain)
        again = llm.generate([prompt], asking)[0]
        cached = llm.generate([prompt], plain)[0]
    finally:
        llm.engine.close()
    assert again.num_cached_tokens == 0
    _check(prompt, again.prompt_logprobs, reference(prompt))
    assert cached.num_cached_tokens > 0
    assert cached.prompt_logprobs is None


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
