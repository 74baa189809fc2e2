"""Speculative decoding's draft rule: how many of its drafts each decoding row verifies this
step.

A verified draft costs what its token adds to the step's time (the performance model's
estimate) and is worth the decode rows it saves when it holds: where a request's drafts each
hold with probability a given that the one before held, its j-th draft saves a^j rows on
average. Every other token of the step is work the requests need, worth one (a decode row makes
its token; a prompt token is computed once either way). The rule takes drafts, the most likely
first, as far as they raise the step's work per second. A memory-bound step (one stream on a
CPU, a small batch on a GPU) barely lengthens with a few more rows, so nearly every draft is
verified; on a compute-bound step a row costs as much as any token and only a near-certain
draft pays; and drafts only take the token budget the step's needed work left, never displacing
a prompt chunk (vLLM's own measurements: speculation 1.4-1.8x slower at high request rates).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bulletserve.perf.execution_state import fused_step_state
from bulletserve.perf.model import PerfModel

# Draft positions the server-wide rate counts for in a request's own estimate: a request's
# first drafts are judged mostly by how drafts fare elsewhere.
PRIOR_POSITIONS = 2.0
# The server-wide rate's own prior: where no draft was verified lately, half hold.
FIRST_PRIOR = 0.5
# What each step leaves of a tally's evidence: drafts verified 20 steps ago count a third.
# So a request (or a server) whose drafts stopped holding and whose drafting the rule stopped
# drifts back to the prior and tries again, at a small cost, instead of never drafting again.
FADE = 0.95


def acceptance_estimate(accepted: float, rejected: float, prior: float) -> float:
    """The chance that a draft holds given the one before it held: the accepted drafts over
    the positions verified rows decided (each accepted draft, and the one that ended a row
    where one was rejected), shrunk towards `prior`."""
    return (accepted + PRIOR_POSITIONS * prior) / (accepted + rejected + PRIOR_POSITIONS)


@dataclass
class AcceptanceTally:
    """How verified drafts fared (a request's, or every request's), the older fading."""

    accepted: float = 0.0
    rejected: float = 0.0

    def fade(self) -> None:
        """A step went by."""
        self.accepted *= FADE
        self.rejected *= FADE

    def add(self, accepted: int, rejected: int) -> None:
        self.accepted += accepted
        self.rejected += rejected

    def estimate(self, prior: float = FIRST_PRIOR) -> float:
        """`acceptance_estimate` of this tally."""
        return acceptance_estimate(self.accepted, self.rejected, prior)


@dataclass(frozen=True)
class DraftRow:
    """A decoding row that may carry drafts: its context with its own token, the drafts on
    offer and the chance each holds after the one before (`acceptance_estimate`)."""

    context: int
    drafts: int
    acceptance: float


@dataclass(frozen=True)
class StepWork:
    """A step's needed work before any draft: its prompt chunks as (new tokens, cached tokens)
    and its decode rows' contexts (those that may carry drafts included)."""

    prefill: list[tuple[int, int]]
    decode_ctx: list[int]


StepTime = Callable[[StepWork, list[int]], float]


@dataclass(frozen=True)
class DraftRule:
    """Drafts priced by a step-time estimate: `step_time(work, drafts)` is the seconds of a step
    of `work` whose decode rows carry `drafts[i]` drafts each."""

    step_time: StepTime

    @classmethod
    def from_perf(cls, perf: PerfModel, units: int) -> DraftRule:
        """Priced by the performance model for a step on `units` units (its online corrections
        as they stand at each step)."""

        def step_time(work: StepWork, drafts: list[int]) -> float:
            state, phase = fused_step_state(work.prefill, work.decode_ctx, units, drafts)
            prediction = perf.predict(state)
            return prediction.prefill_s if phase == "prefill" else prediction.decode_s

        return cls(step_time)

    def choose(
        self, work: StepWork, rows: dict[int, DraftRow], budget_tokens: int
    ) -> dict[int, int]:
        """How many drafts to verify for each row of `rows` (keyed by its index in
        `work.decode_ctx`; those not given none), at most `budget_tokens` in all."""
        # Each draft position's worth: a^j for the j-th of a row. Within a row the worth falls
        # with j, so the best positions overall take each row's drafts from its first.
        offers = sorted(
            (
                (-(row.acceptance**j), index)
                for index, row in rows.items()
                for j in range(1, row.drafts + 1)
            ),
        )[: max(budget_tokens, 0)]
        if not offers:
            return {}
        needed = sum(n for n, _ in work.prefill) + len(work.decode_ctx)
        best_count, best_rate = 0, needed / self.step_time(work, [0] * len(work.decode_ctx))
        worth = float(needed)
        # The step's rate is checked at 1, 2, 4, ... of the best offers and at all of them: a
        # few estimates a step, and the rate, a concave gain over a convex cost, has one peak.
        checks = {min(1 << k, len(offers)) for k in range(len(offers).bit_length() + 1)}
        taken = 0
        for count in sorted(checks):
            while taken < count:
                worth -= offers[taken][0]
                taken += 1
            rate = worth / self.step_time(work, _per_row(offers[:count], len(work.decode_ctx)))
            if rate > best_rate:
                best_count, best_rate = count, rate
        chosen = _per_row(offers[:best_count], len(work.decode_ctx))
        return {index: count for index, count in enumerate(chosen) if count}


def _per_row(offers: list[tuple[float, int]], num_rows: int) -> list[int]:
    """Drafts per decode row that the chosen offers make."""
    drafts = [0] * num_rows
    for _, index in offers:
        drafts[index] += 1
    return drafts
