"""Speculative decoding's draft rule (sched/drafts.py): a step verifies the drafts worth their
cost, from a step-time estimate; the plans stay valid with drafts in them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bulletserve.model.presets import PRESETS
from bulletserve.perf.execution_state import ExecutionState, fused_step_state
from bulletserve.perf.hardware import load_preset
from bulletserve.perf.inventory import decode_counts, prefill_counts
from bulletserve.perf.model import PerfModel
from bulletserve.sched.base import SchedulerSnapshot, SeqView, blocks_needed
from bulletserve.sched.chunked import ChunkedPolicy
from bulletserve.sched.drafts import (
    FIRST_PRIOR,
    AcceptanceTally,
    DraftRow,
    DraftRule,
    acceptance_estimate,
)
from bulletserve.sched.prefill_first import PrefillFirstPolicy

BLOCK = 16


def linear(fixed_s: float, per_token_s: float) -> DraftRule:
    """A step of n decode rows and drafts takes fixed + n x per-token seconds."""

    def step_time(contexts: list[int], drafts: list[int]) -> float:
        return fixed_s + per_token_s * (len(contexts) + sum(drafts))

    return DraftRule(step_time)


def decoding(name: str, drafts: int, acceptance: float, context: int = 100) -> SeqView:
    """A running request decoding its next token, `drafts` on offer."""
    blocks = -(-context // BLOCK)
    return SeqView(
        name, 0.0, context, context - 1, blocks, num_output_tokens=5,
        num_draft_tokens=drafts, draft_acceptance=acceptance,
    )  # fmt: skip


def plan_of(policy, running, waiting=(), free_blocks=1000, budget=2048):
    snapshot = SchedulerSnapshot(
        0.0, tuple(waiting), tuple(running), free_blocks, BLOCK, 64, budget
    )
    return {s.request_id: s.num_tokens for s in policy.plan(snapshot).scheduled}


def test_a_memory_bound_step_verifies_every_likely_draft():
    """One stream, a step that barely lengthens with rows: every draft pays while a^j is
    above the per-token share of the step."""
    rule = linear(fixed_s=10e-3, per_token_s=0.05e-3)
    plan = plan_of(ChunkedPolicy(2048, rule), [decoding("a", 5, 0.7)])
    assert plan == {"a": 6}
    # Drafts that never hold cost their rows for nothing.
    assert plan_of(ChunkedPolicy(2048, rule), [decoding("a", 5, 0.0)]) == {"a": 1}


def test_a_compute_bound_step_verifies_none():
    """Every token costs the same: a draft saves less than its row costs unless it is
    certain, so a step of many decodes verifies nothing."""
    rule = linear(fixed_s=0.0, per_token_s=1e-3)
    running = [decoding(f"r{i}", 5, 0.8) for i in range(32)]
    assert set(plan_of(ChunkedPolicy(2048, rule), running).values()) == {1}


def test_prompt_chunks_beside_the_decode_rows_do_not_change_the_choice():
    """A chunk's work is the same with or without drafts beside it: the rule prices the drafts
    against the decode rows alone, so a step carrying a prompt verifies what one without
    would."""
    rule = linear(fixed_s=20e-3, per_token_s=1e-3)
    running = [decoding(f"r{i}", 4, 0.9) for i in range(8)]
    alone = plan_of(ChunkedPolicy(2048, rule), running)
    beside = plan_of(ChunkedPolicy(2048, rule), running, [SeqView("w", 1.0, 900, 0, 0)])
    assert beside.pop("w") == 900 and beside == alone
    assert sum(alone.values()) > len(running)


def test_between_the_two_the_likeliest_drafts_go_first():
    """A step whose fixed cost is that of 16 tokens: with 16 rows, the first drafts of the
    request whose drafts hold most are worth it, a second request's weaker ones are not."""
    rule = linear(fixed_s=16e-3, per_token_s=1e-3)
    running = [decoding("sure", 5, 0.95), decoding("unsure", 5, 0.3)]
    running += [decoding(f"r{i}", 0, 0.0) for i in range(14)]
    plan = plan_of(ChunkedPolicy(2048, rule), running)
    assert plan["sure"] > 1 and plan["unsure"] == 1
    assert all(plan[f"r{i}"] == 1 for i in range(14))


def test_drafts_never_displace_a_prompt_chunk():
    """The chunk fills what the decode rows leave of the budget: no room for drafts, however
    cheap; with budget to spare they take only the rest."""
    rule = linear(fixed_s=10e-3, per_token_s=0.0)
    running = [decoding("a", 5, 0.9)]
    waiting = [SeqView("w", 1.0, 500, 0, 0)]
    assert plan_of(ChunkedPolicy(64, rule), running, waiting) == {"a": 1, "w": 63}
    assert plan_of(ChunkedPolicy(64, None), running, waiting) == {"a": 1, "w": 63}
    short = [SeqView("w", 1.0, 60, 0, 0)]
    assert plan_of(ChunkedPolicy(64, rule), running, short) == {"a": 4, "w": 60}


def test_without_a_rule_every_draft_is_verified_as_the_budget_and_blocks_allow():
    running = [decoding("a", 5, 0.0, context=32), decoding("b", 5, 0.0, context=32)]
    # Both rows sit at a block's end: their drafts need a new block each, and one is free.
    plan = plan_of(PrefillFirstPolicy(), running, free_blocks=1)
    assert plan == {"a": 6, "b": 1}


def test_a_request_without_evidence_tries_its_drafts_and_faded_evidence_tries_again():
    """Thin evidence is met with optimism: a request's drafts are tried before anything is
    known of them; drafts that stopped holding are then weighed low, and once the rule stopped
    verifying them the evidence fades and the estimate rises back, so the request tries again."""
    tally = AcceptanceTally()
    assert tally.mean() == FIRST_PRIOR and tally.estimate(FIRST_PRIOR) == 1.0
    tally.add(0, 30)
    low = tally.estimate(0.6)
    assert low < 0.2
    for _ in range(100):
        tally.fade()
    assert tally.estimate(0.6) > 0.9
    tally.add(40, 2)
    assert 0.9 < tally.estimate(0.1) < 1.0
    assert acceptance_estimate(0, 0, 0.3) == 0.8  # the prior, and the optimism of no evidence


def test_the_performance_model_prices_a_verify_row_as_its_tokens():
    """A decode row of 1 + d tokens: d more rows through every GEMM and the LM head, each
    attending to the tokens before it; on a device's preset a step of 32 rows with 4 drafts
    each costs more than without them, and one row's drafts almost nothing."""
    ctx = (100, 200)
    tokens, pairs, kv_read, seqs = decode_counts(ctx, (3, 0))
    assert (tokens, seqs) == (5, 5)
    assert pairs == 100 + 101 + 102 + 103 + 200 and kv_read == 303
    # The same tokens and attention as a prompt chunk of 4 on 99 cached (one logits row).
    assert prefill_counts((4,), (99,))[:2] == decode_counts((100,), (3,))[:2]
    perf = PerfModel(PRESETS["llama-3.1-8b"], load_preset("h100-sxm"), "bfloat16")
    units = perf.hw.units

    def decode_s(rows: int, drafts: int) -> float:
        state, phase = fused_step_state([], [1000] * rows, units, [drafts] * rows)
        assert phase == "decode"
        return perf.predict(state).decode_s

    assert decode_s(1, 4) < 1.05 * decode_s(1, 0)
    assert decode_s(256, 4) > 1.5 * decode_s(256, 0)
    state = ExecutionState(decode_ctx=(5, 6), decode_units=units, decode_drafts=(1, 2))
    assert state.decode_rows == 5


def test_the_rule_priced_by_the_model_drafts_for_one_stream_and_not_for_many():
    perf = PerfModel(PRESETS["llama-3.1-8b"], load_preset("h100-sxm"), "bfloat16")
    rule = DraftRule.from_perf(perf, perf.hw.units)
    for acceptance in (0.2, 0.7):
        one = rule.choose([500], {0: DraftRow(5, acceptance)}, 2048)
        assert one[0] >= 4  # the last one's 0.2^5 is within the estimate's noise
    # 512 rows on an H100: weak drafts cost more than they save, likely ones fewer per row.
    rows = {i: DraftRow(5, 0.2) for i in range(512)}
    assert rule.choose([500] * 512, rows, 2048) == {}
    rows = {i: DraftRow(5, 0.7) for i in range(512)}
    assert 0 < sum(rule.choose([500] * 512, rows, 2048).values()) < 5 * 512


@st.composite
def snapshots_with_drafts(draw) -> SchedulerSnapshot:
    running = []
    for i in range(draw(st.integers(0, 10))):
        num_tokens = draw(st.integers(2, 300))
        if draw(st.booleans()):  # decoding, drafts on offer
            seq = decoding(f"r{i}", draw(st.integers(0, 6)), draw(st.floats(0, 1)), num_tokens)
        else:
            computed = draw(st.integers(0, num_tokens - 1))
            seq = SeqView(f"r{i}", float(i), num_tokens, computed, -(-computed // BLOCK))
        running.append(seq)
    waiting = [SeqView(f"w{i}", 50.0 + i, draw(st.integers(1, 300)), 0, 0) for i in range(3)]
    return SchedulerSnapshot(
        0.0, tuple(waiting), tuple(running), draw(st.integers(0, 100)), BLOCK,
        draw(st.integers(max(1, len(running)), 16)), draw(st.integers(1, 512)),
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(snapshots_with_drafts(), st.sampled_from([None, (10e-3, 0.1e-3), (0.0, 1e-3)]))
def test_plans_with_drafts_stay_within_budget_blocks_and_offers(snapshot, timing):
    rule = None if timing is None else linear(*timing)
    by_id = {s.request_id: s for s in snapshot.running + snapshot.waiting}
    for policy in (ChunkedPolicy(256, rule), PrefillFirstPolicy(rule)):
        plan = policy.plan(snapshot)
        limit = snapshot.max_num_batched_tokens
        if isinstance(policy, ChunkedPolicy):
            assert plan.num_tokens <= min(256, limit)
        freed = sum(by_id[i].num_blocks for i in plan.preempted)
        needed = sum(
            blocks_needed(by_id[s.request_id], s.num_tokens, BLOCK) for s in plan.scheduled
        )
        assert needed <= snapshot.free_blocks + freed
        for item in plan.scheduled:
            seq = by_id[item.request_id]
            assert 1 <= item.num_tokens <= seq.num_remaining + seq.num_draft_tokens
            if item.num_tokens > seq.num_remaining:
                assert seq.num_remaining == 1 and seq.num_output_tokens


def test_a_verify_step_is_priced_with_its_drafts_in_a_fused_step():
    state, phase = fused_step_state([(30, 0)], [100, 50], 8, [2, 0])
    assert phase == "prefill"
    assert state.prefill_lens == (30, 3, 1) and state.prefill_cached == (0, 99, 49)
