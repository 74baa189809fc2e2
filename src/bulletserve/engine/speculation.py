"""Speculative decoding in the engine: drafts proposed for the decoding requests before a step
is planned, and each verified row's tokens drawn position by position after it.

A verified row computes its last token and its d drafts in one forward, with logits at each of
the 1 + d positions. Its tokens are then drawn as decoding one at a time would draw them: at
position j the request's logits are processed (grammar, penalties, bias, min_tokens, forced
tokens) with every token before j already in its output, the token is drawn from that
distribution with the request's own generator, and handed to its life (stops, limits); the row
goes on to j + 1 only while the drawn token equals draft j. A draft proposed without a
distribution of its own (n-gram lookup, suffix decoding, a draft model's argmax: q one-hot) is
accepted with probability p(draft), and where it is not, the token drawn is distributed as p
without the draft, renormalized: exactly rejection sampling's min(1, p/q) and max(p - q, 0),
and the last position's token is the bonus. So the output is the one decoding without
speculation gives, token for token (greedy) and draw for draw (a seeded request consumes one
uniform per token either way), logprobs included. A draft model's draft drawn at an unseeded
request's temperature carries its q, and the draw at its position is rejection sampling
proper (`engine.sampler.Proposal`): the same distribution, not the same draws.
"""

from __future__ import annotations

import time

import torch

from bulletserve.engine.draft_model import DraftModel, DraftRow
from bulletserve.engine.life import RequestLife
from bulletserve.engine.request import Request
from bulletserve.engine.sampler import Proposal, Sampler
from bulletserve.sched.drafts import DraftTallies
from bulletserve.spec.config import SpeculativeConfig
from bulletserve.spec.counters import SpecCounters
from bulletserve.spec.proposer import Proposer, draft_room


class Speculator:
    """Drafts for decoding requests and the verification of their rows (`verify`)."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None
    ) -> None:
        """`draft`: the draft model, under method draft_model; else the method's proposer
        indexes each request's tokens."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.proposer = None if draft is not None else Proposer(config)
        self._drafting: dict[str, Request] = {}
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self.tallies = DraftTallies()
        self.propose_s = 0.0  # the last proposal's seconds, for the step log
        # Per request, the distribution each of its drafts was drawn from, where the draft
        # model drew them at its temperature (else its drafts are one-hot).
        self._probs: dict[str, list[torch.Tensor]] = {}

    def propose(self, running: list[Request]) -> None:
        """Set each decoding request's drafts (none for a prefilling one), no more than its
        max_tokens and the context length leave room for after the token its row draws, and
        the chance that each holds (`sched.drafts.acceptance_estimate`)."""
        started = time.perf_counter()
        self.tallies.step_started()
        live = set()
        rows: list[tuple[Request, int]] = []
        for request in running:
            live.add(request.request_id)
            request.draft_token_ids = []
            room = draft_room(
                self.config,
                request.num_tokens,
                request.num_computed_tokens,
                len(request.output_token_ids),
                request.params.max_tokens,
                self.max_model_len,
            )
            if room <= 0:
                continue
            self._drafting[request.request_id] = request
            rows.append((request, room))
        self._probs.clear()
        if self.draft is not None:
            drafted = self.draft.propose(
                [
                    DraftRow(r.request_id, r.token_ids(0, r.num_tokens), room, _draws_at(r))
                    for r, room in rows
                ]
            )
            proposals = []
            for (request, _), (drafts, probs) in zip(rows, drafted, strict=True):
                proposals.append(drafts)
                if probs is not None:
                    self._probs[request.request_id] = probs
        else:
            assert self.proposer is not None
            proposals = [
                self.proposer.propose(r.request_id, r.prompt_token_ids, r.output_token_ids, room)
                for r, room in rows
            ]
        for (request, _), drafts in zip(rows, proposals, strict=True):
            request.draft_token_ids = drafts
            request.draft_acceptance = self.tallies.estimate(request.request_id)
        for request_id in [r for r in self._drafting if r not in live]:
            self._forget(request_id)
        self.propose_s = time.perf_counter() - started

    def _forget(self, request_id: str) -> None:
        """A request left the running set (finished, aborted or preempted): its proposer's
        state goes (a finished one's output joins suffix decoding's cache)."""
        gone = self._drafting.pop(request_id)
        self.tallies.forget(request_id)
        if self.draft is not None:
            self.draft.forget(request_id)
        else:
            assert self.proposer is not None
            finished = gone.output_token_ids if gone.is_finished else None
            self.proposer.forget(request_id, finished)

    @torch.inference_mode()
    def verify(
        self,
        rows: list[Request],
        logits: torch.Tensor,
        sampler: Sampler,
        life: RequestLife,
        now: float,
    ) -> dict[str, int]:
        """Draw every sampling row's tokens (`rows`: each logits row's request, a verified
        row's 1 + d in a run) and hand them to the requests' lives; per request that carried
        drafts, how many of them the model rejected."""
        runs: list[tuple[Request, int, list[int]]] = []  # request, its first row, its drafts
        for row, request in enumerate(rows):
            if runs and runs[-1][0] is request:
                continue
            end = row + 1
            while end < len(rows) and rows[end] is request:
                end += 1
            runs.append((request, row, request.draft_token_ids[: end - row - 1]))
        counters = self.counters
        rejected: dict[str, int] = {}
        for request, _, drafts in runs:
            if drafts:
                rejected[request.request_id] = len(drafts)
                counters.num_drafts += 1
                counters.num_draft_tokens += len(drafts)
        active = [run for run in runs if not run[0].is_finished]
        position = 0
        while active:
            requests = [request for request, _, _ in active]
            chosen = logits  # every row, each its own request's (no drafts): no copy
            if len(active) < logits.shape[0]:
                rows_now = [first + position for _, first, _ in active]
                chosen = logits.index_select(0, torch.tensor(rows_now, device=logits.device))
            proposals = None
            if self._probs:
                proposals = [
                    Proposal(drafts[position], self._probs[request.request_id][position])
                    if request.request_id in self._probs and position < len(drafts)
                    else None
                    for request, _, drafts in active
                ]
            draw = sampler.draw(chosen, requests, [r.stop_ids for r in requests], proposals)
            tokens, logprobs = draw.read()
            going = []
            for (request, first, drafts), token, logprob in zip(
                active, tokens, logprobs, strict=True
            ):
                life.append_token(request, token, logprob, now)
                if request.is_finished or position >= len(drafts):
                    continue
                held = token == drafts[position]
                self.tallies.record(request.request_id, held)
                if not held:
                    continue
                rejected[request.request_id] -= 1
                counters.num_accepted_tokens += 1
                counters.accepted_per_position[position] += 1
                going.append((request, first, drafts))
            active = going
            position += 1
        self._probs.clear()
        for request, _, _ in runs:
            request.draft_token_ids = []
            if request.is_finished and request.request_id in self._drafting:
                self._forget(request.request_id)  # no later step may come to free its state
        return rejected


def _draws_at(request: Request) -> float | None:
    """The temperature a draft model draws a request's drafts at: an unseeded random request's
    own (rejection sampling keeps its distribution), else None: the draft's argmax, so that a
    seeded request draws one uniform per token and its text is the one without speculation."""
    params = request.params
    if params.greedy or params.seed is not None:
        return None
    return params.temperature
