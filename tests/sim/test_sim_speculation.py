"""Speculative decoding in the simulator: drafts drawn from an acceptance trace, chosen by the
engine's draft rule and priced by the performance model; every request still makes exactly its
output, and the run reports the engine's counters."""

from __future__ import annotations

import pytest

from bulletserve.sched.slo import SLO
from bulletserve.sim.benchmark import SimConfig, simulate
from bulletserve.sim.speculation import AcceptanceTrace
from bulletserve.spec.counters import SpecCounters

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _run(rate: float, **kw) -> dict:
    config = SimConfig(
        hardware="h200",
        model="llama-3.1-8b",
        dataset="sharegpt-like",
        num_prompts=40,
        request_rates=(rate,),
        slo=SLO(3.0, 150.0),
        **kw,
    )
    (run,) = simulate(config).runs
    return run.summary | {"requests": run.requests}


def _outputs(run: dict) -> list[int]:
    return [r.output_len for r in run["requests"]]


def test_drafts_that_hold_cut_tpot_and_every_request_makes_its_output():
    off = _run(0.5)
    trace = AcceptanceTrace(0.9, (0.8, 0.75, 0.7, 0.7))
    on = _run(0.5, speculative_config=NGRAM, spec_acceptance=trace)
    assert _outputs(on) == _outputs(off)
    spec = on["spec_decode"]
    assert spec["num_drafts"] > 0 and 2.0 < spec["mean_acceptance_length"] < 4.0
    assert on["tpot_ms"]["mean"] < 0.7 * off["tpot_ms"]["mean"]


def test_drafts_that_never_hold_are_cut_by_the_rule_and_cost_little():
    """A burst of 40 requests on an H200: verifying every draft, as vLLM, costs each step its
    rows' drafts (TPOT 1.25x, measured); the rule soon weighs a request's drafts low and keeps
    only a first one where the step barely notices it (its optimism about thin evidence: the
    evidence fades, so it tries again), at a few percent."""
    never = AcceptanceTrace(1.0, (0.0,))
    off = _run(64.0)
    rule = _run(64.0, speculative_config=NGRAM, spec_acceptance=never)
    every = _run(64.0, speculative_config=NGRAM | {"adaptive": False}, spec_acceptance=never)
    assert rule["spec_decode"]["num_accepted_tokens"] == 0
    drafted = rule["spec_decode"]["num_draft_tokens"]
    assert drafted < every["spec_decode"]["num_draft_tokens"] / 2
    assert rule["tpot_ms"]["mean"] <= 1.05 * off["tpot_ms"]["mean"]
    assert every["tpot_ms"]["mean"] > 1.15 * off["tpot_ms"]["mean"]


def test_the_trace_is_read_from_flags_and_from_a_runs_counters():
    trace = AcceptanceTrace.parse("0.8:0.9,0.85")
    assert trace == AcceptanceTrace(0.8, (0.9, 0.85))
    counters = SpecCounters(10, 40, 27, [9, 8, 6, 4])
    measured = AcceptanceTrace.of_counters(counters, decode_rows=20)
    assert measured.proposal_rate == 0.5
    assert measured.holds == pytest.approx((0.9, 8 / 9, 6 / 8, 4 / 6))
    short = AcceptanceTrace.of_counters(SpecCounters(10, 20, 3, [3, 0, 0]), decode_rows=10)
    assert short.holds == pytest.approx((0.3, 0.0))  # the third position was never reached
    for bad in ("0.8", "2:0.5", "0.5:x", "0.5:"):
        with pytest.raises(ValueError, match="spec-acceptance|chances"):
            AcceptanceTrace.parse(bad)


def test_speculation_needs_a_trace():
    trace = AcceptanceTrace(0.5, (0.5,))
    with pytest.raises(ValueError, match="--spec-acceptance"):
        SimConfig(hardware="h200", model="llama-3.1-8b", speculative_config=NGRAM)
    with pytest.raises(ValueError, match="without --speculative-config"):
        SimConfig(hardware="h200", model="llama-3.1-8b", spec_acceptance=trace)


def test_bullets_decode_lane_verifies_drafts_and_every_request_makes_its_output():
    off = _run(0.5, policy="bullet")
    trace = AcceptanceTrace(0.9, (0.8, 0.75, 0.7, 0.7))
    on = _run(0.5, policy="bullet", speculative_config=NGRAM, spec_acceptance=trace)
    assert _outputs(on) == _outputs(off)
    spec = on["spec_decode"]
    assert spec["num_drafts"] > 0 and 2.0 < spec["mean_acceptance_length"] < 4.0
    assert on["tpot_ms"]["mean"] < 0.7 * off["tpot_ms"]["mean"]
