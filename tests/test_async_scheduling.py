"""--async-scheduling on a tiny random model (fp32, CPU): each step planned and launched before
the last one's tokens are read back gives what the serial engine gives, token for token."""

from __future__ import annotations

import pytest

from bulletserve import LLM, SamplingParams
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.model_runner import ModelRunner
from bulletserve.engine.structured import StructuredOutputs
from tests.tiny_models import GREEDY, TINY_LLAMA_BLOCK_BYTES, random_prompts, tiny_llm


def _count_fed_rows(llm: LLM, monkeypatch) -> list[int]:
    """Rows per step that took their input token from the step before's draw."""
    fed_rows: list[int] = []
    execute = ModelRunner.execute

    def counting(runner, works, *args, fed=None, **kwargs):
        fed_rows.append(0 if fed is None else len(fed.rows))
        return execute(runner, works, *args, fed=fed, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", counting.__get__(llm.engine.runner))
    return fed_rows


@pytest.mark.parametrize(
    "settings",
    [
        {"policy": "chunked"},
        {"policy": "chunked", "chunked_prefill_size": 5},
        {"policy": "prefill-first"},
        {"policy": "chunked", "kv_cache_memory": str(20 * TINY_LLAMA_BLOCK_BYTES)},
        {"policy": "prefill-first", "kv_cache_memory": str(20 * TINY_LLAMA_BLOCK_BYTES)},
    ],
    ids=["chunked", "chunked-5", "prefill-first", "chunked-preempt", "pf-preempt"],
)
def test_the_overlapped_plan_gives_the_serial_plans_greedy_outputs(
    tiny_llama_dir, alone_outputs, settings, monkeypatch
):
    llm = tiny_llm(tiny_llama_dir, async_scheduling=True, **settings)
    fed_rows = _count_fed_rows(llm, monkeypatch)
    outputs = llm.generate(random_prompts(10, seed=5), GREEDY)
    assert [o.token_ids for o in outputs] == alone_outputs
    assert sum(fed_rows) > 0  # decode rows did run before their input was on the host
    if "kv_cache_memory" in settings:
        assert sum(o.num_preemptions for o in outputs) > 0
    assert llm.engine.pool.allocator.num_used == 0 and not llm.engine.has_unfinished()


def test_stops_logprobs_seeds_and_constraints_match_the_serial_engine(tiny_llama_dir, monkeypatch):
    """Requests that end early (EOS, stop tokens and strings, length), ask for logprobs (of
    their prompt too), draw with their own seeds, or read their own output (a penalty,
    min_tokens, a grammar: each draws after the step before is read back), and prompts
    repeated for the prefix cache.
    Slow (about 10 s): two engines, each request kind run under both."""
    prompts = random_prompts(12, seed=21, low=20, high=50)
    prompts += prompts[:4]
    params = [
        SamplingParams(max_tokens=3 + i % 7, temperature=0, ignore_eos=bool(i % 2))
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(max_tokens=20, temperature=0.9, seed=7, logprobs=2)
    params[2] = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3)
    params[3] = SamplingParams(max_tokens=20, temperature=0, min_tokens=6)
    params[4] = SamplingParams(
        max_tokens=8,
        temperature=0,
        structured_outputs=StructuredOutputs("choice", choices=("yes", "no")),
    )
    params[5] = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=3)
    params[8] = SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1)
    serial = tiny_llm(tiny_llama_dir)
    overlapped = tiny_llm(tiny_llama_dir, async_scheduling=True)
    try:  # closed after: the grammar's compiler processes end with their engine
        full = serial.generate([prompts[6]], SamplingParams(max_tokens=20, temperature=0))[0]
        stop_id, stop = full.token_ids[4], full.text[3:5]
        params[6] = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])
        params[7] = SamplingParams(max_tokens=20, temperature=0, stop=[stop])
        expected = serial.generate(prompts, params)
        fed_rows = _count_fed_rows(overlapped, monkeypatch)
        got = overlapped.generate(prompts, params)
    finally:
        serial.engine.close()
        overlapped.engine.close()
    assert sum(fed_rows) > 0
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.text == want.text
        assert have.finish_reason == want.finish_reason
        if want.prompt_logprobs is not None:
            assert [lp and lp.token_id for lp in have.prompt_logprobs] == [
                lp and lp.token_id for lp in want.prompt_logprobs
            ]
        if want.logprobs is not None:
            assert [lp.token_id for lp in have.logprobs] == [lp.token_id for lp in want.logprobs]
            assert [lp.logprob for lp in have.logprobs] == pytest.approx(
                [lp.logprob for lp in want.logprobs]
            )
    assert got[4].text in ("yes", "no")
    assert overlapped.engine.pool.allocator.num_used == 0


def test_an_abort_while_its_step_runs_ends_the_request_once(tiny_llama_dir):
    engine = tiny_llm(tiny_llama_dir, async_scheduling=True).engine
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(4, seed=14)]
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished() and engine.pool.allocator.num_used > 0
    engine.abort_request(ids[0])
    outputs = engine.step()
    for _ in range(2):
        outputs += engine.step()
    ended = [o for o in outputs if o.request_id == ids[0]]
    assert [o.finish_reason for o in ended] == ["abort"]
    for request_id in ids[1:]:
        engine.abort_request(request_id)
    for _ in range(3):
        if not engine.has_unfinished():
            break
        engine.step()
    assert engine.pool.allocator.num_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"policy": "bullet"}, "one-lane policies"),
        ({"tensor_parallel_size": 2}, "tensor-parallel-size"),
    ],
)
def test_async_scheduling_refuses_what_it_does_not_run(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(async_scheduling=True, **settings)
