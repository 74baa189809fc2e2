"""Workloads with shared prefixes: the same segments give the same tokens through the server's
tokenizer, and in the simulator, whose prefix cache then finds them."""

from __future__ import annotations

import pytest

from bulletserve.bench.datasets import load_lengths, load_workload
from bulletserve.bench.shared import TURNS, shared_prompts
from bulletserve.sim.benchmark import SimConfig, make_sim_policy, setup, simulate_requests
from bulletserve.sim.workload import arrivals_for, make_requests, prompt_tokens
from tests.tiny_models import needs_default_model


def test_shared_prefix_requests_share_a_system_prompt():
    prompts = shared_prompts("shared-prefix", 40, seed=1)
    systems = {p.segments[0].key for p in prompts}
    assert 1 < len(systems) <= 4
    assert len({p.segments[1].key for p in prompts}) == 40  # every question its own
    tokens = [p.token_ids() for p in prompts]
    first = prompts[0].segments[0].length
    same = [
        t for p, t in zip(prompts, tokens, strict=True) if p.segments[0] == prompts[0].segments[0]
    ]
    assert len(same) > 1 and all(t[:first] == tokens[0][:first] for t in same)
    assert all(t[first:] != tokens[0][first:] for t in same[1:])


def test_multi_turn_resends_the_history_turn_by_turn():
    prompts = shared_prompts("multi-turn", 10, seed=2)
    conversations = -(-10 // TURNS)
    # First turns go out first; turn 2 of conversation 0 extends its turn 1 by a reply and a
    # new user message.
    assert [len(p.segments) for p in prompts[:conversations]] == [1] * conversations
    second = prompts[conversations]
    assert second.segments[0] == prompts[0].segments[0] and len(second.segments) == 3
    assert second.token_ids()[: prompts[0].input_len] == prompts[0].token_ids()


@pytest.mark.parametrize("kind", ["shared-prefix", "multi-turn"])
def test_the_lengths_fit_a_short_context(kind):
    for input_len, output_len, _ in load_lengths(kind, 50, seed=3, max_model_len=400):
        assert input_len + output_len <= 400


@needs_default_model
@pytest.mark.parametrize("kind", ["shared-prefix", "multi-turn"])
def test_the_servers_prompts_share_tokens_where_the_segments_do(tokenizer, kind):
    requests = load_workload(kind, 12, tokenizer, seed=4, max_model_len=2048)
    prompts = shared_prompts(kind, 12, seed=4, max_model_len=2048)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    assert [len(i) for i in ids] == [r.input_len for r in requests]
    assert [r.input_len for r in requests] == [p.input_len for p in prompts]
    for a in range(12):
        for b in range(a):
            shared = 0
            for x, y in zip(prompts[a].segments, prompts[b].segments, strict=False):
                if x != y:
                    break
                shared += x.length
            assert ids[a][:shared] == ids[b][:shared]


def test_the_simulator_finds_the_shared_system_prompts():
    config = SimConfig(
        hardware="a100-80g", model="llama-3.1-8b", policy="chunked", dataset="shared-prefix"
    )
    env = setup(config)
    lengths = load_lengths("shared-prefix", 60, seed=0)
    arrivals = arrivals_for(lengths, 4.0, 1.0, 0, False)
    tokens = prompt_tokens("shared-prefix", 60, 0, None)
    ttft = {}
    for caching in (True, False):
        cfg = SimConfig(**{**config.__dict__, "enable_prefix_caching": caching})
        requests = make_requests(lengths, arrivals, tokens)
        result = simulate_requests(cfg, env, make_sim_policy(cfg, env), requests, 4.0)
        ttft[caching] = result.summary["ttft_ms"]["mean"]
    assert ttft[True] < 0.8 * ttft[False]
