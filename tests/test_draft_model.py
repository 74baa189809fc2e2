"""Speculative decoding with a draft model: a smaller model of the target's tokenizer drafts for
every decoding request in batched forwards, on its own KV; the output is the one decoding
without speculation gives, under each policy; its tokenizer is checked against the target's.

The draft here is the tiny target with noise added to every weight, so that its greedy
choices agree with the target's often but not always: some drafts are accepted, some
rejected."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bulletserve import SamplingParams
from bulletserve.engine.config import EngineConfig
from bulletserve.spec.config import SpeculativeConfig
from tests.tiny_models import TINY_LLAMA_BLOCK_BYTES, random_prompts, tiny_llm

NOISE = 0.006  # measured: about half the first drafts and a sixth of the fourth held


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft") / "noisy"
    shutil.copytree(tiny_llama_dir, folder)
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    noisy = {
        name: tensor + NOISE * torch.randn(tensor.shape, generator=generator)
        for name, tensor in weights.items()
    }
    save_file(noisy, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _config(draft_dir, **extra):
    return {
        "method": "draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 4,
        "adaptive": False,
    } | extra


def _pools_empty(llm) -> bool:
    draft = llm.engine.executor.speculator.draft
    return llm.engine.pool.allocator.num_used == 0 and draft.pool.allocator.num_used == 0


@pytest.mark.parametrize("policy", ["chunked", "bullet"])  # prefill-first verifies as chunked
def test_outputs_equal_without_speculation_greedy_and_seeded(tiny_llama_dir, draft_dir, policy):
    plain = tiny_llm(tiny_llama_dir, policy=policy)
    spec = tiny_llm(tiny_llama_dir, policy=policy, speculative_config=_config(draft_dir))
    try:
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        seeded = SamplingParams(
            temperature=0.8, seed=11, max_tokens=24, ignore_eos=True, logprobs=1,
            repetition_penalty=1.1,
        )  # fmt: skip
        for prompts, params in (
            (random_prompts(6, seed=5), greedy),
            (random_prompts(4, seed=9), seeded),
        ):
            expected = plain.generate(prompts, params, use_tqdm=False)
            got = spec.generate(prompts, params, use_tqdm=False)
            assert [o.token_ids for o in got] == [o.token_ids for o in expected]
            assert _pools_empty(spec)
        counters = spec.engine.executor.speculator.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        if policy != "chunked":
            return  # the draw is the sampler's, whichever lane verifies
        # Unseeded and random: drafts drawn at the request's temperature and verified by
        # rejection sampling (its distribution: tests/test_sampler.py); the outputs keep their
        # lengths and most drafts hold, the draft being the target with a little noise.
        before = counters.copy()
        sampled = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
        outputs = spec.generate(random_prompts(4, seed=13), sampled, use_tqdm=False)
        assert all(len(o.token_ids) == 20 for o in outputs) and _pools_empty(spec)
        run = spec.engine.executor.speculator.counters - before
        assert run.num_accepted_tokens > run.num_draft_tokens / 2
    finally:
        plain.close()
        spec.close()


def test_preemption_and_aborts_free_both_pools(tiny_llama_dir, draft_dir):
    small = {
        "kv_cache_memory": str(12 * TINY_LLAMA_BLOCK_BYTES),
        "max_model_len": 128,
        "chunked_prefill_size": 64,
    }
    plain = tiny_llm(tiny_llama_dir, **small)
    spec = tiny_llm(tiny_llama_dir, speculative_config=_config(draft_dir), **small)
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        prompts = random_prompts(6, seed=17, low=30, high=60)
        expected = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert spec.engine.book.num_preemptions > 0 and _pools_empty(spec)
        engine = spec.engine
        for index, prompt in enumerate(prompts[:4]):
            engine.add_request(prompt, params, request_id=f"abort-{index}")
        for _ in range(6):
            engine.step()
        for index in range(4):
            engine.abort_request(f"abort-{index}")
        for _ in range(50):
            if not engine.has_unfinished():
                break
            engine.step()
        engine.step()  # the step after the aborts forgets their drafting state
        assert _pools_empty(spec)
    finally:
        plain.close()
        spec.close()


def test_a_draft_of_another_tokenizer_is_refused_naming_it(tiny_llama_dir, draft_dir, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(draft_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(str(other))
    tokenizer.add_tokens(["<an-extra-token>"])
    tokenizer.save_pretrained(str(other))
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        tiny_llm(tiny_llama_dir, speculative_config=_config(other))


def test_the_settings_as_vllms_and_what_is_refused():
    config = SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        "some/draft",
        3,
    )
    assert "drafts by some/draft" in config.describe()
    assert SpeculativeConfig.parse(config.to_dict()) == config
    for value, message in (
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
        ({"model": "m"}, "num_speculative_tokens"),
        ({"model": "m", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "be 1"),
        ({"model": "m", "num_speculative_tokens": 3, "quantization": "awq"}, "quantization"),
        ({"model": "m", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, "not taken"),
    ):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config=config)
