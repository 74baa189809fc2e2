"""What the performance model says about the ways the lanes could run next: each lane alone,
side by side on a split, or fused into one step. The rules (rules.py) decide from these."""

from __future__ import annotations

from dataclasses import dataclass

from bulletserve.perf.execution_state import ExecutionState, fused_step_state
from bulletserve.perf.model import Corrections, PerfModel, StepPrediction
from bulletserve.sched.base import SeqView
from bulletserve.sched.bullet.params import BulletParams
from bulletserve.sched.bullet.types import Fusion, UnitSpace
from bulletserve.sched.drafts import DraftRule
from bulletserve.sched.slo import SLO


@dataclass(frozen=True)
class Estimator:
    """Predictions under one snapshot's online corrections. `slo`: the server's, for requests
    without their own; `decode_tpot_s`: the decode lane's TPOT target, the tightest of its
    requests' (None: the server's)."""

    perf: PerfModel
    units: UnitSpace
    slo: SLO
    params: BulletParams
    num_layers: int
    corrections: Corrections = Corrections()
    decode_tpot_s: float | None = None

    def slo_of(self, seq: SeqView) -> SLO:
        return seq.slo or self.slo

    @property
    def tpot_s(self) -> float:
        return self.slo.tpot_s if self.decode_tpot_s is None else self.decode_tpot_s

    @property
    def tpot_budget_s(self) -> float:
        return self.tpot_s * self.params.tpot_headroom

    def predict(self, es: ExecutionState) -> StepPrediction:
        return self.perf.predict(es, self.corrections)

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """A prefill of one prompt of `tokens` after `cached` on every unit."""
        es = ExecutionState(
            prefill_lens=(tokens,), prefill_cached=(cached,), prefill_units=self.units.total
        )
        return self.predict(es).prefill_s

    def ttft_outlook(self, seq: SeqView, now: float) -> tuple[float, float]:
        """(a waiting prompt's TTFT were its prefill to start now, alone on every unit; its TTFT
        target). The target is its whole prompt's (what the SLO is scored on), the work only
        what its cached prefix leaves."""
        work = self.prefill_s(seq.num_remaining, seq.num_computed_tokens)
        return now - seq.arrival_time + work, self.slo_of(seq).ttft_s(seq.num_tokens)

    def at_risk(self, seq: SeqView, now: float) -> bool:
        """Whether a waiting prompt's TTFT outlook passes the risk share of its target."""
        ttft, target = self.ttft_outlook(seq, now)
        return ttft >= self.params.risk_share * target

    def rank(self, seq: SeqView) -> tuple[int, float]:
        """Which request comes first (the smaller): the higher priority, then the tighter TPOT
        target; `sched.base.keep_order`'s order, with the server's SLO where a request has none
        of its own."""
        return seq.priority, self.slo_of(seq).tpot_s

    def behind_tpot(self, seq: SeqView, now: float) -> bool:
        """Whether a decoding request's TPOT, were its next token to come now, would pass the
        TPOT headroom of its own target."""
        if seq.first_token_time is None or seq.num_output_tokens < 1:
            return False
        tpot = (now - seq.first_token_time) / seq.num_output_tokens
        return tpot > self.params.tpot_headroom * self.slo_of(seq).tpot_s

    def past_deadline(self, seq: SeqView, now: float) -> bool:
        """Whether a waiting prompt would miss its TTFT target even if its prefill started now,
        alone on every unit."""
        ttft, target = self.ttft_outlook(seq, now)
        return ttft > target

    def alone_s(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
    ) -> tuple[float, float]:
        """(prefill step, decode step) each alone on every unit."""
        total = self.units.total
        prefill = self.predict(
            ExecutionState(
                prefill_lens=prefill_lens,
                prefill_cached=_cached(cached),
                prefill_units=total,
                prefill_layers=layers,
            )
        ).prefill_s
        decode = self.predict(ExecutionState(decode_ctx=decode_ctx, decode_units=total)).decode_s
        return prefill, decode

    def side_by_side(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
        decode_units: int,
    ) -> StepPrediction:
        """Both lanes at once, decode on `decode_units` and prefill on the rest."""
        return self.predict(
            ExecutionState(
                prefill_lens=prefill_lens,
                prefill_cached=_cached(cached),
                prefill_units=self.units.total - decode_units,
                decode_ctx=decode_ctx,
                decode_units=decode_units,
                prefill_layers=layers,
            )
        )

    def draft_rule(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        layers: int,
        decode_units: int,
    ) -> DraftRule:
        """Drafts priced by the decode lane's step on `decode_units` beside the prefill lane's
        step of `prefill_lens` on the rest (none: the decode lane alone on its units)."""
        if not prefill_lens:
            return DraftRule.from_perf(self.perf, decode_units, self.corrections)

        def step_time(contexts: list[int], drafts: list[int]) -> float:
            state = ExecutionState(
                prefill_lens=prefill_lens,
                prefill_cached=_cached(cached),
                prefill_units=self.units.total - decode_units,
                decode_ctx=tuple(contexts),
                decode_units=decode_units,
                decode_drafts=tuple(drafts) if any(drafts) else (),
                prefill_layers=layers,
            )
            return self.predict(state).decode_s

        return DraftRule(step_time)

    def fewest_decode_units(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
    ) -> int:
        """Fewest units that keep the co-running decode step within the TPOT budget and that it
        does not outlast the prefill step beside it (leaving the prefill lane at least its
        minimum); all but the minimum when none does. A step keeps its units until it ends, so a
        decode step squeezed onto the fewest units that keep TPOT beside a short prefill would
        run on for most of a TPOT after the prefill's units went idle."""
        counts = self.units.counts()
        candidates = [d for d in counts if self.units.total - d >= self.units.least_remainder]
        keeps_tpot = False  # decode_s falls as d grows: once true, true for every larger d
        for d in candidates:
            prediction = self.side_by_side(prefill_lens, cached, decode_ctx, layers, d)
            keeps_tpot = keeps_tpot or prediction.decode_s <= self.tpot_budget_s
            if keeps_tpot and prediction.decode_s <= prediction.prefill_s:
                return d
        return candidates[-1] if candidates else counts[0]

    def co_running_shares(
        self,
        now: float,
        batch: tuple[SeqView, ...],
        lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
        remaining_layers: int,
        d: int,
    ) -> float:
        """The work a second of the lanes side by side, decode on `d` units (its fewest,
        `fewest_decode_units`), against the lanes taking turns on every unit (1.0): each lane
        side by side runs at some share of its speed alone, and the shares sum past 1 where
        sharing gains. 0.0 when decode would leave prefill no unit, or a prompt of the batch
        would reach the at-risk share of its TTFT budget at the slower side-by-side speed."""
        if self.units.total - d <= 0:
            return 0.0
        side_by_side = self.side_by_side(lens, cached, decode_ctx, layers, d)
        prefill_left_s = side_by_side.prefill_s * remaining_layers / layers
        risk = self.params.risk_share
        in_time = all(
            now - s.arrival_time + prefill_left_s < risk * self.slo_of(s).ttft_s(s.num_remaining)
            for s in batch
        )
        if not in_time:
            return 0.0
        prefill_alone, decode_alone = self.alone_s(lens, cached, decode_ctx, layers)
        return prefill_alone / side_by_side.prefill_s + decode_alone / side_by_side.decode_s

    def decode_can_pause(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
    ) -> bool:
        """Whether a prefill step on every unit followed by a decode step on every unit still
        fits the TPOT budget: then decode may wait out the prefill step."""
        return sum(self.alone_s(prefill_lens, cached, decode_ctx, layers)) <= self.tpot_budget_s

    def fused_step(
        self, prompts: tuple[SeqView, ...], chunk: int | None, decode_ctx: tuple[int, ...]
    ) -> Fusion:
        """A step of `prompts` (the next `chunk` tokens of the one prompt, if set) and a token of
        every decoding request, on every unit."""
        if chunk is None:
            pieces = [(s.num_remaining, s.num_computed_tokens) for s in prompts]
        else:
            pieces = [(chunk, prompts[0].num_computed_tokens)]
        lens = tuple(n for n, _ in pieces)
        cached = tuple(c for _, c in pieces)
        prefill_alone, decode_alone = self.alone_s(lens, cached, decode_ctx, self.num_layers)
        fused, _ = fused_step_state(pieces, list(decode_ctx), self.units.total)
        seconds = self.predict(fused).prefill_s
        return Fusion(prompts, chunk, (prefill_alone + decode_alone) / seconds, seconds)

    def longest_fitting_step(
        self,
        batch: tuple[SeqView, ...],
        whole: Fusion,
        decode_ctx: tuple[int, ...],
        limit_s: float,
    ) -> Fusion | None:
        """The fused step with the most prompt tokens from the batch's front within `limit_s`:
        the whole batch (`whole`); else the most whole prompts from its front (the decode rows
        cost the same however few prompt tokens ride with them, so a step of the first prompt
        alone would spend its time on decode); else the longest chunk of the first prompt, in
        multiples of the chunk granule; else None."""
        if whole.seconds <= limit_s:
            return whole
        fits = None
        for count in range(1, len(batch)):
            candidate = self.fused_step(batch[:count], None, decode_ctx)
            if candidate.seconds > limit_s:
                break
            fits = candidate
        if fits is not None:
            return fits
        first, granule = batch[0], self.params.chunk_granule
        # A fused step's time grows with its chunk: bisect for the longest that fits.
        low, high = 1, -(-first.num_remaining // granule)
        while low <= high:
            middle = (low + high) // 2
            tokens = min(middle * granule, first.num_remaining)
            chunk = tokens if tokens < first.num_remaining else None
            candidate = self.fused_step((first,), chunk, decode_ctx)
            if candidate.seconds <= limit_s:
                fits, low = candidate, middle + 1
            else:
                high = middle - 1
        return fits

    def saturation_tokens(self) -> int:
        """Prompt tokens at which a prefill on every unit stops getting cheaper per token: past
        it, a bigger batch only delays the first request's TTFT."""
        best = None
        for tokens in (2**k for k in range(4, 15)):
            per_token = self.prefill_s(tokens) / tokens
            if best is not None and per_token > self.params.saturation_ratio * best:
                return tokens // 2
            best = per_token if best is None else min(best, per_token)
        return 2**14


def _cached(cached: tuple[int, ...]) -> tuple[int, ...]:
    """Prompts' tokens already in the KV cache as ExecutionState takes them (() for none)."""
    return cached if any(cached) else ()
