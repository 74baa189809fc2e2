"""Speculative decoding's draft rule: how many of its drafts each decoding row verifies this
step.

A decode token costs a share of the step that makes it: the decode rows' time (the
performance model's estimate, plus the engine's own time around a step, measured) over the
tokens they make. A verified draft adds its row's time
and, where a request's drafts each hold with probability a given that the one before held, its
j-th draft makes a^j tokens on average. The rule takes drafts, the most likely first, as far as
they lower the cost of a decode token: where the step's fixed cost dominates (one stream on a
CPU, a small batch on a GPU), a few more rows barely lengthen it and nearly every draft is
verified; where it computes rather than reads, a row costs as much as the token it might save
and only near-certain drafts pay (vLLM's own measurements: speculation 1.4-1.8x slower at high
request rates). Prompt chunks in the same step are left out of the sum: their work is the same
with or without drafts beside them, and weighed in they would make drafts look dearer in just
the steps that carry them. Drafts only take the token budget the step's needed work left,
never displacing a prompt chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from bulletserve.perf.execution_state import fused_step_state
from bulletserve.perf.model import Corrections, PerfModel

# Draft positions the server-wide rate counts for in a request's own estimate: a request's
# first drafts are judged mostly by how drafts fare elsewhere.
PRIOR_POSITIONS = 2.0
# The server-wide rate's own prior: where no draft was verified lately, half hold.
FIRST_PRIOR = 0.5
# What each step leaves of a tally's evidence: drafts verified 20 steps ago count a third.
# So a request (or a server) whose drafts stopped holding and whose drafting the rule stopped
# drifts back to the prior and tries again, at a small cost, instead of never drafting again.
FADE = 0.95


# The optimism of a request's estimate where its evidence is thin: EXPLORE / sqrt(1 + positions
# decided) above the mean. A request whose drafts were never verified has them tried (its
# estimate 1 at first), and one whose evidence faded tries again; with 16 positions decided
# the estimate is within 0.12 of its mean.
EXPLORE = 0.5


def acceptance_estimate(accepted: float, rejected: float, prior: float) -> float:
    """The chance that a draft holds given the one before it held, as the rule weighs it: the
    accepted drafts over the positions verified rows decided (each accepted draft, and the one
    that ended a row where one was rejected), shrunk towards `prior`, plus the optimism of
    thin evidence (`EXPLORE`), at most 1."""
    decided = accepted + rejected
    mean = (accepted + PRIOR_POSITIONS * prior) / (decided + PRIOR_POSITIONS)
    return min(1.0, mean + EXPLORE / math.sqrt(1.0 + decided))


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

    def mean(self) -> float:
        """The share of decided positions whose draft held (`FIRST_PRIOR` before any): the
        prior of each request's estimate."""
        decided = self.accepted + self.rejected
        return (self.accepted + PRIOR_POSITIONS * FIRST_PRIOR) / (decided + PRIOR_POSITIONS)

    def estimate(self, prior: float) -> float:
        """`acceptance_estimate` of this tally."""
        return acceptance_estimate(self.accepted, self.rejected, prior)


class DraftTallies:
    """What the estimates are made from, as the engine and the simulator keep it: each
    drafting request's tally and every request's together (its prior)."""

    def __init__(self) -> None:
        self.overall = AcceptanceTally()
        self._by_request: dict[str, AcceptanceTally] = {}
        self._prior = FIRST_PRIOR

    def step_started(self) -> None:
        """A step is being planned: every tally's evidence fades by a step, whether its
        request was offered drafts in it or not."""
        self.overall.fade()
        for tally in self._by_request.values():
            tally.fade()
        self._prior = self.overall.mean()

    def estimate(self, request_id: str) -> float:
        """A decoding request's estimate for this step."""
        tally = self._by_request.setdefault(request_id, AcceptanceTally())
        return tally.estimate(self._prior)

    def record(self, request_id: str, held: bool) -> None:
        """A verified position was decided: its draft held or the row ended there."""
        self.overall.add(held, not held)
        tally = self._by_request.get(request_id)
        if tally is not None:
            tally.add(held, not held)

    def forget(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)


@dataclass(frozen=True)
class DraftRow:
    """A decoding row's drafts on offer and the chance each holds after the one before
    (`acceptance_estimate`)."""

    drafts: int
    acceptance: float


StepTime = Callable[[list[int], list[int]], float]


@dataclass(frozen=True)
class DraftRule:
    """Drafts priced by a step-time estimate: `step_time(contexts, drafts)` is the seconds of a
    step of decode rows at `contexts` (each with its own token), carrying `drafts[i]` drafts
    each."""

    step_time: StepTime

    @classmethod
    def from_perf(
        cls, perf: PerfModel, units: int, corrections: Corrections | None = None
    ) -> DraftRule:
        """Priced by the performance model for a step on `units` units, under `corrections`
        (None: its online corrections as they stand at each step)."""

        def step_time(contexts: list[int], drafts: list[int]) -> float:
            state, _ = fused_step_state([], contexts, units, drafts)
            return perf.predict(state, corrections).decode_s

        return cls(step_time)

    def choose(
        self,
        contexts: list[int],
        rows: dict[int, DraftRow],
        budget_tokens: int,
        host_s: float = 0.0,
    ) -> dict[int, int]:
        """How many drafts to verify for each row of `rows` (keyed by its index in the step's
        decode rows, at `contexts`; those not given none), at most `budget_tokens` in all.
        `host_s`: the engine's own time around a step, a fixed part of its price (fewer steps
        for the same tokens save it)."""
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
        num_rows = len(contexts)
        best_count = 0
        best_rate = num_rows / (host_s + self.step_time(contexts, [0] * num_rows))
        worth = float(num_rows)
        # The step's rate is checked at counts of the best offers half as many again each
        # (1, 2, 3, 5, 8, 12, ...) and at all of them: a few estimates a step for the peak of a
        # concave gain over a convex cost.
        taken = 0
        for count in _counts_to_check(len(offers)):
            while taken < count:
                worth -= offers[taken][0]
                taken += 1
            drafts = _per_row(offers[:count], num_rows)
            rate = worth / (host_s + self.step_time(contexts, drafts))
            if rate > best_rate:
                best_count, best_rate = count, rate
        chosen = _per_row(offers[:best_count], num_rows)
        return {index: count for index, count in enumerate(chosen) if count}


def _counts_to_check(most: int) -> list[int]:
    """1, then half as many again each time (rounded up), up to `most`, and `most`."""
    counts, count = [], 1
    while count < most:
        counts.append(count)
        count = max(count + 1, -(-count * 3 // 2))
    return [*counts, most]


def _per_row(offers: list[tuple[float, int]], num_rows: int) -> list[int]:
    """Drafts per decode row that the chosen offers make."""
    drafts = [0] * num_rows
    for _, index in offers:
        drafts[index] += 1
    return drafts
