"""Speculative decoding on the modeled device: which decoding rows have drafts on offer and how
many of them hold, drawn from an acceptance trace measured on a real model, or, for a request
whose output is known (a real run's, replayed), the engine's own proposer's drafts over it,
held as far as they match it (what greedy verification accepts); which of them a step
verifies, by the engine's own rule (sched/drafts.py, priced by the same performance model), and
its estimates kept by the engine's own tallies. The verify rows' cost is the performance
model's (a decode row of 1 + k tokens)."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from bulletserve.sched.drafts import DraftTallies
from bulletserve.sim.request import SimRequest
from bulletserve.spec.config import SpeculativeConfig
from bulletserve.spec.counters import SpecCounters
from bulletserve.spec.proposer import Proposer, draft_room


@dataclass(frozen=True)
class AcceptanceTrace:
    """What a proposer did on a real model: the share of decode rows it offered drafts for,
    and for each draft position the chance the draft held given the one before it did."""

    proposal_rate: float
    holds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.proposal_rate <= 1 or not all(0 <= h <= 1 for h in self.holds):
            raise ValueError("an acceptance trace's proposal rate and holds are chances, in [0, 1]")
        if not self.holds:
            raise ValueError("an acceptance trace needs a chance for at least one position")

    @classmethod
    def parse(cls, text: str) -> AcceptanceTrace:
        """From `RATE:H1,H2,...` (`--spec-acceptance`), e.g. 0.8:0.9,0.85,0.8,0.75."""
        rate, sep, holds = text.partition(":")
        try:
            if not sep:
                raise ValueError
            return cls(float(rate), tuple(float(h) for h in holds.split(",")))
        except ValueError as exc:
            detail = f": {exc}" if str(exc) else ""
            raise ValueError(
                f"--spec-acceptance takes RATE:H1,H2,... (chances in [0, 1]), not {text!r}{detail}"
            ) from None

    def flag(self) -> str:
        """As `--spec-acceptance` takes it."""
        return f"{self.proposal_rate:.3f}:" + ",".join(f"{h:.3f}" for h in self.holds)

    @classmethod
    def of_counters(cls, counters: SpecCounters, decode_rows: int) -> AcceptanceTrace:
        """From a run's counters (`vllm:spec_decode_*`) and the decode rows it ran."""
        if not counters.num_drafts or not decode_rows:
            raise ValueError("a trace needs a run that verified drafts")
        # Positions no verified draft reached are left out: the last measured chance serves.
        held = [counters.num_drafts, *counters.accepted_per_position]
        holds = tuple(
            after / before for before, after in zip(held, held[1:], strict=False) if before
        )
        return cls(min(1.0, counters.num_drafts / decode_rows), holds)


class SimSpeculation:
    """Drafts for the simulated requests and their verification (`verify`)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        trace: AcceptanceTrace,
        seed: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.trace = trace
        self.max_model_len = max_model_len
        self._random = random.Random(seed)
        # A replayed request's drafts come from the engine's proposer (not a draft model's).
        self.proposer = Proposer(config) if config.method in ("ngram", "suffix") else None
        self.tallies = DraftTallies()
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self._drafting: dict[str, SimRequest] = {}  # as the engine's Speculator keeps them
        self._drafts: dict[str, list[int]] = {}  # a replayed request's drafts on offer

    def propose(self, running: list[SimRequest]) -> None:
        """Offer drafts to the decoding requests, as many as the engine's proposer would be
        allowed (its max_tokens, the context length and `num_speculative_tokens`): a
        replayed request the proposer's, any other where the trace's proposal rate draws
        one."""
        self.tallies.step_started()
        live = set()
        self._drafts.clear()
        for request in running:
            live.add(request.request_id)
            request.draft_count = 0
            room = draft_room(
                self.config,
                request.num_tokens,
                request.num_computed_tokens,
                len(request.token_times),
                request.output_len,
                self.max_model_len,
            )
            if room <= 0:
                continue
            self._drafting[request.request_id] = request
            if request.output_token_ids is not None:
                if self.proposer is None:
                    raise ValueError(
                        f"{self.config.method}: a replayed output takes the drafts of an "
                        "n-gram or suffix proposer, not a model's"
                    )
                drafts = self.proposer.propose(
                    request.request_id,
                    request.token_ids(0, request.input_len),
                    request.output_token_ids[: len(request.token_times)],
                    room,
                )
                if not drafts:
                    continue
                self._drafts[request.request_id] = drafts
                room = len(drafts)
            elif self._random.random() >= self.trace.proposal_rate:
                continue
            request.draft_count = room
            request.draft_acceptance = self.tallies.estimate(request.request_id)
        for request_id in [r for r in self._drafting if r not in live]:
            gone = self._drafting.pop(request_id)
            self.tallies.forget(request_id)
            if self.proposer is not None:
                finished = gone.finished_at is not None and gone.output_token_ids is not None
                self.proposer.forget(request_id, gone.output_token_ids if finished else None)

    def verify(self, rows: Iterable[tuple[SimRequest, int]]) -> list[tuple[SimRequest, int, int]]:
        """Of a step's rows (request, drafts it verifies), those that verified drafts:
        (request, drafts, accepted), each position drawn in turn from the trace until one does
        not hold. Every row's offer ends with the step."""
        verified = []
        holds = self.trace.holds
        counters = self.counters
        rows = list(rows)
        for request, drafts in rows:
            if request.draft_count <= 0 or drafts <= 0:
                continue
            accepted = 0
            replayed = self._drafts.get(request.request_id)
            while accepted < drafts:
                if replayed is not None:
                    assert request.output_token_ids is not None
                    position = len(request.token_times) + accepted
                    held = replayed[accepted] == request.output_token_ids[position]
                else:
                    held = self._random.random() < holds[min(accepted, len(holds) - 1)]
                self.tallies.record(request.request_id, held)
                if not held:
                    break
                counters.accepted_per_position[accepted] += 1
                accepted += 1
            counters.num_drafts += 1
            counters.num_draft_tokens += drafts
            counters.num_accepted_tokens += accepted
            verified.append((request, drafts, accepted))
        for request, _ in rows:
            request.draft_count = 0
        return verified
