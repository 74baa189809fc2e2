"""Speculative decoding (n-gram drafts verified in one step): the output is the one decoding
without speculation gives, token for token, under every request field; rejected drafts leave
no KV block behind; bad settings are refused naming what is wrong.

The tiny random model never repeats itself, so drafts would never be accepted: a logit bias
holds its outputs to three tokens (the model still chooses among them), whose n-grams recur,
so that each step's drafts are partly accepted and partly rejected."""

from __future__ import annotations

import json

import httpx
import pytest

from bulletserve import SamplingParams
from bulletserve.bookkeeping.record import read_step_log
from bulletserve.cli import main
from bulletserve.engine.structured import StructuredOutputs
from bulletserve.spec.config import SpeculativeConfig
from bulletserve.spec.ngram import NgramIndex
from bulletserve.spec.suffix import SuffixCache, SuffixDrafter, SuffixTrie
from tests.server.harness import need_tokenizer, running_app, tiny_engine
from tests.tiny_models import TINY_LLAMA_BLOCK_BYTES, random_prompts, tiny_llm

# Every draft verified: how many a step verifies does not depend on measured step times.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
# " red", " green", " blue" in the default model's tokenizer, which the tiny models share.
THREE_TOKENS = {2382: 60.0, 2654: 60.0, 4461: 60.0}


@pytest.fixture(scope="module", params=["chunked", "prefill-first", "bullet"])
def engines(request, tiny_llama_dir):
    """The same model without and with speculation, under one policy."""
    plain = tiny_llm(tiny_llama_dir, policy=request.param)
    spec = tiny_llm(tiny_llama_dir, policy=request.param, speculative_config=NGRAM)
    yield plain, spec
    plain.close()
    spec.close()


def _counters(llm):
    return llm.engine.executor.speculator.counters


def _same(plain, spec, prompts, params):
    before = _counters(spec).num_accepted_tokens
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.text == want.text and have.finish_reason == want.finish_reason
    assert _counters(spec).num_accepted_tokens > before  # some drafts held
    assert spec.engine.pool.allocator.num_used == 0
    return expected, got


def test_greedy_outputs_equal_without_speculation_one_and_many_streams(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logit_bias=THREE_TOKENS)
    _same(plain, spec, random_prompts(1, seed=2), params)
    _same(plain, spec, random_prompts(12, seed=5), params)
    counters = _counters(spec)
    assert counters.num_accepted_tokens < counters.num_draft_tokens  # and some were rejected
    assert counters.accepted_per_position[0] >= counters.accepted_per_position[-1]


@pytest.mark.parametrize("engines", ["chunked", "bullet"], indirect=True)  # prefill-first: greedy
def test_seeded_sampling_penalties_and_logprobs_equal_draw_for_draw(engines):
    """A seeded request draws one uniform per token either way: the same text, and the same
    logprobs (computed in a verified row rather than a decode row: within float error)."""
    plain, spec = engines
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, logit_bias=THREE_TOKENS,
        logprobs=2, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
        top_p=0.9, min_tokens=30,
    )  # fmt: skip
    expected, got = _same(plain, spec, random_prompts(6, seed=7), params)
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.logprobs, have.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("engines", ["chunked", "bullet"], indirect=True)  # prefill-first: greedy
def test_n_sequences_and_prompt_logprobs_equal_without_speculation(engines):
    plain, spec = engines
    params = SamplingParams(
        n=2, temperature=0.8, seed=5, max_tokens=30, ignore_eos=True, logit_bias=THREE_TOKENS,
        prompt_logprobs=2,
    )  # fmt: skip
    prompts = random_prompts(3, seed=29)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        assert [s.token_ids for s in have.outputs] == [s.token_ids for s in want.outputs]
        for a, b in zip(want.prompt_logprobs[1:], have.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("engines", ["chunked", "bullet"], indirect=True)  # prefill-first: greedy
def test_a_stop_inside_an_accepted_run_ends_the_output_exactly_there(engines):
    plain, spec = engines
    prompts = random_prompts(6, seed=11)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias=THREE_TOKENS)
    outputs = plain.generate(prompts, free, use_tqdm=False)
    # A stop token and a stop string each first met well into an output.
    stop_id = outputs[0].token_ids[20]
    stop_text = plain.tokenizer.decode(outputs[1].token_ids[25:27])
    for params in (
        SamplingParams(
            temperature=0, max_tokens=40, logit_bias=THREE_TOKENS, stop_token_ids=[stop_id]
        ),
        SamplingParams(temperature=0, max_tokens=40, logit_bias=THREE_TOKENS, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logit_bias=THREE_TOKENS),
    ):
        expected, _ = _same(plain, spec, prompts, params)
        assert any(out.finish_reason == "stop" for out in expected) or params.max_tokens == 17


@pytest.mark.parametrize("engines", ["chunked"], indirect=True)  # each engine compiles
def test_a_grammar_holds_every_verified_token(engines):
    """A regex over the three tokens' text: each position's mask is the grammar's after the
    tokens before it, and a draft outside it is never accepted."""
    plain, spec = engines
    pattern = "( red| green| blue)+"
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        logit_bias=THREE_TOKENS,
        structured_outputs=StructuredOutputs("regex", pattern),
    )
    _same(plain, spec, random_prompts(4, seed=13), params)


@pytest.mark.parametrize("policy", ["chunked", "bullet"])
def test_aborts_and_preemption_mid_verify_leave_no_block(tiny_llama_dir, policy):
    """A pool too small for every request at once: requests are preempted with drafts in
    flight and recompute; every block comes back, and the outputs are still the plain ones."""
    small = {
        "kv_cache_memory": str(12 * TINY_LLAMA_BLOCK_BYTES),
        "max_model_len": 128,
        "chunked_prefill_size": 64,
        "policy": policy,
    }
    plain = tiny_llm(tiny_llama_dir, **small)
    spec = tiny_llm(tiny_llama_dir, speculative_config=NGRAM, **small)
    try:
        params = SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, logit_bias=THREE_TOKENS
        )
        prompts = random_prompts(6, seed=17, low=30, high=60)
        _same(plain, spec, prompts, params)
        assert spec.engine.book.num_preemptions > 0
        engine = spec.engine
        for index, prompt in enumerate(prompts[:4]):
            engine.add_request(prompt, params, request_id=f"abort-{index}")
        for _ in range(6):
            engine.step()
        assert _counters(spec).num_drafts > 0
        for index in range(4):
            engine.abort_request(f"abort-{index}")
        for _ in range(200):
            if not engine.has_unfinished():
                break
            engine.step()
        assert engine.pool.allocator.num_used == 0
    finally:
        plain.close()
        spec.close()


@pytest.mark.parametrize("engines", ["chunked"], indirect=True)  # each start spawns a rank
def test_two_tensor_parallel_ranks_verify_as_one_does(engines, tiny_llama_dir):
    """Under tensor parallelism the other rank runs each verified row's positions too (the
    works it is sent carry their logits rows): the outputs of one rank without speculation."""
    plain, _ = engines
    spec = tiny_llm(
        tiny_llama_dir,
        policy=plain.engine.config.policy,
        tensor_parallel_size=2,
        kv_cache_memory="64MiB",
        speculative_config=NGRAM,
    )
    try:
        params = SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, logit_bias=THREE_TOKENS
        )
        _same(plain, spec, random_prompts(5, seed=23), params)
    finally:
        spec.close()


def test_the_step_log_carries_each_steps_drafted_and_accepted_tokens(tiny_llama_dir, tmp_path):
    log = tmp_path / "steps.jsonl"
    spec = tiny_llm(tiny_llama_dir, speculative_config=NGRAM, step_log=str(log))
    try:
        params = SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, logit_bias=THREE_TOKENS
        )
        spec.generate(random_prompts(3, seed=19), params, use_tqdm=False)
        counters = _counters(spec)
    finally:
        spec.close()
    records = read_step_log(log)
    assert all(r.draft_tokens is not None and r.accepted_tokens is not None for r in records)
    assert all(0 <= r.propose_s < 1 for r in records)
    assert sum(r.draft_tokens for r in records) == counters.num_draft_tokens
    assert sum(r.accepted_tokens for r in records) == counters.num_accepted_tokens > 0


@pytest.mark.parametrize("policy", ["chunked", "bullet"])
def test_adaptive_speculation_prices_each_step_and_keeps_the_outputs(
    tiny_llama_dir, tmp_path, policy
):
    """The default: the draft rule prices each step's drafts by the performance model (its
    device profile measured at start, corrected by each step's measured time; under Bullet on
    the units the split gives the decode lane), and the step log shows its estimate. How many
    drafts it verifies depends on the times measured (the rule's choices are tested in
    test_sched_drafts.py); the outputs are the ones decoding gives."""
    adaptive = {key: value for key, value in NGRAM.items() if key != "adaptive"}
    log = tmp_path / "steps.jsonl"
    plain = tiny_llm(tiny_llama_dir)
    spec = tiny_llm(tiny_llama_dir, policy=policy, speculative_config=adaptive, step_log=str(log))
    try:
        assert any(
            "the drafts worth their cost verified" in line for line in spec.engine.describe()
        )
        params = SamplingParams(
            temperature=0, max_tokens=60, ignore_eos=True, logit_bias=THREE_TOKENS
        )
        prompts = random_prompts(3, seed=29)
        expected = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        counters = _counters(spec)
        assert spec.engine.pool.allocator.num_used == 0
    finally:
        plain.close()
        spec.close()
    records = read_step_log(log)
    assert all(r.predicted_s is not None and r.predicted_s > 0 for r in records)
    decode = [r for r in records if r.lane != "prefill"]
    assert sum(r.draft_tokens for r in decode) == counters.num_draft_tokens > 0
    assert all(r.propose_s is not None for r in decode)


def test_the_ngram_index_proposes_what_followed_the_longest_recent_match():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3])
    # "2 3" ends the sequence; its last earlier occurrence was followed by 4, 5.
    assert index.propose(2) == [4, 5]
    index.extend([4])
    # "2 3 4" (the longest) occurred at 5..7, followed by 5, 2, 3, 4.
    assert index.propose(10) == [5, 2, 3, 4]
    assert NgramIndex(2, 2).propose(3) == []


@pytest.mark.parametrize("engines", ["chunked"], indirect=True)  # verification is shared
def test_suffix_decoding_outputs_equal_without_speculation_and_draft_from_past_outputs(
    engines, tiny_llama_dir
):
    """The suffix trie's drafts verified exactly as the n-gram's (greedy, many streams; the
    verification is the one the n-gram's tests hold under both policies); its global trie then
    holds the finished requests' outputs, and a request repeating one is drafted from it."""
    plain, _ = engines
    policy = plain.engine.config.policy
    spec = tiny_llm(tiny_llama_dir, policy=policy, speculative_config=SUFFIX)
    try:
        params = SamplingParams(
            temperature=0, max_tokens=48, ignore_eos=True, logit_bias=THREE_TOKENS
        )
        prompts = random_prompts(8, seed=31)
        _same(plain, spec, prompts, params)
        speculator = spec.engine.executor.speculator
        assert speculator.proposer.suffix_cache.trie.num_nodes > 0
        (first,) = plain.generate(prompts[:1], params, use_tqdm=False)
        drafter = SuffixDrafter([7, 7], speculator.proposer.suffix_cache, 1.0, 0.1)
        drafter.extend(first.token_ids[:20])
        assert drafter.propose(4) == first.token_ids[20:24]
    finally:
        spec.close()


def test_the_suffix_trie_follows_the_most_frequent_continuation_of_the_longest_match():
    trie = SuffixTrie(8)
    seq = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    trie.add(seq)
    # "1 2 3" ends the sequence (its own end has no continuation yet); before, it was
    # followed twice by 4 (share 1), then once each by 5 and 6 (share 1/2).
    assert trie.propose(seq, 5, 1.0, 0.1) == ([4, 5, 1], 2.0)  # 3 tokens for a 3-token match
    assert trie.propose(seq, 5, 4.0, 0.1) == ([4, 5, 1, 2, 3], 3.0)
    assert trie.propose(seq, 5, 4.0, 0.6) == ([4], 1.0)  # 5 or 6: under the share asked
    assert trie.propose([9, 9], 5, 4.0, 0.1) == ([], 0.0)
    # A match as long as the trie is deep leaves no room below it: half of it is used, which
    # earns (factor 1) as many tokens as the depth leaves.
    deep = SuffixTrie(24)
    text = list(range(100)) * 2
    deep.add(text[:150])
    assert deep.propose(text[:150], 24, 1.0, 0.1) == (list(range(50, 62)), 12.0)
    trie.remove(seq)
    assert trie.root.children == {} and trie.num_nodes == 0


def test_thesuffix_cache_is_bounded_in_requests_and_nodes():
    def counted(node) -> int:
        return sum(1 + counted(child) for child in node.children.values())

    cache = SuffixCache(24, max_requests=3)
    outputs = [random_prompts(1, seed=seed, low=50, high=60)[0] for seed in range(6)]
    for output in outputs:
        cache.add(output)
    assert list(cache._outputs) == outputs[-3:]
    assert cache.trie.num_nodes == counted(cache.trie.root)
    fresh = SuffixCache(24, max_requests=3)
    for output in outputs[-3:]:
        fresh.add(output)
    assert fresh.trie.num_nodes == cache.trie.num_nodes  # the oldest left no trace
    small = SuffixCache(24, max_requests=100, max_nodes=2000)
    for output in outputs:
        small.add(output)
        assert small.trie.num_nodes <= 2000 and small.trie.num_nodes == counted(small.trie.root)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "draft head"),
        ({"method": "mtp", "num_speculative_tokens": 1}, "multi-token-prediction"),
        ({"method": "nonsense", "num_speculative_tokens": 3}, "one of ngram"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}, "'bogus'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "above prompt_lookup_max",
        ),  # fmt: skip
        ("{not json", "not JSON"),
        ({"method": "suffix", "prompt_lookup_min": 2}, "'prompt_lookup_min' is not taken"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8},
            "not taken",
        ),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "cached_requests"),
        ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": "yes"}, "adaptive"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_vllms_defaults_and_the_policies_it_runs_under(tiny_llama_dir):
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    high = SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": None, "prompt_lookup_max": 4})
    assert (high.prompt_lookup_min, high.prompt_lookup_max) == (4, 4)
    suffix = SpeculativeConfig.parse('{"method": "suffix"}')
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    assert (suffix.suffix_decoding_max_cached_requests, suffix.adaptive) == (10000, True)
    assert (suffix.suffix_decoding_max_spec_factor, suffix.suffix_decoding_min_token_prob) == (
        1.0,
        0.1,
    )
    with pytest.raises(ValueError, match="async-scheduling"):
        tiny_llm(tiny_llama_dir, async_scheduling=True, speculative_config=NGRAM)


def test_the_server_names_the_method_and_counts_drafts_as_vllm_does(capsys, tmp_path):
    """The startup line, /metrics' counters, and `bullet bench`'s report of a run on the
    grounded workload (its acceptance from the server's counters before and after)."""
    need_tokenizer()
    engine = tiny_engine(speculative_config=NGRAM, max_model_len=2048)
    try:
        line = "speculative decoding: ngram, 4 tokens a step, n-grams of 1-3, every draft verified"
        assert line in engine.describe()
        with running_app(engine) as url:
            body = {
                "model": "tiny", "prompt": "one two three", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "logit_bias": {str(t): b for t, b in THREE_TOKENS.items()},
            }  # fmt: skip
            reply = httpx.post(url + "/v1/completions", json=body, trust_env=False, timeout=60)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 40
            metrics = httpx.get(url + "/metrics", trust_env=False).text
            output = tmp_path / "bench.json"
            argv = [
                "bench", "--base-url", url, "--dataset", "grounded", "--num-prompts", "2",
                "--temperature", "0", "--ignore-eos", "--output", str(output), "--no-progress",
            ]  # fmt: skip
            assert main(argv) == 0
            report = capsys.readouterr().out
    finally:
        engine.shutdown()
    assert "Speculative Decoding" in report and "Acceptance rate (%):" in report
    (run,) = json.loads(output.read_text())["runs"]
    spec = run["summary"]["spec_decode"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
    assert spec["num_drafts"] > 0
    values = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:spec_decode"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    drafts = values['vllm:spec_decode_num_drafts_total{model_name="tiny"}']
    drafted = values['vllm:spec_decode_num_draft_tokens_total{model_name="tiny"}']
    accepted = values['vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}']
    per_position = [
        values[
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{i}"}}'
        ]
        for i in range(4)
    ]
    assert 0 < accepted <= drafted and drafts <= drafted and sum(per_position) == accepted
    # A bad setting on the command line: one line naming it.
    assert main(["serve", "--speculative-config", '{"method": "eagle"}']) == 2
    assert "--speculative-config method 'eagle'" in capsys.readouterr().err
