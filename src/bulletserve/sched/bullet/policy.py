"""Bullet's SLO-aware scheduler (Algorithm 1 of arXiv 2504.19516), pure.

Two lanes run at once: a prefill lane (whole prompts, possibly in layer groups or chunks) and a
decode lane (every decoding request, one token per step, and under speculative decoding the
drafts worth verifying). Each lane asks for a plan at the start
of its step; the plan says what the lane runs and how the device's units are split between the
lanes (rules.py). Decisions come from the snapshot and the performance model's predictions
under the snapshot's corrections, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bulletserve.perf.model import Corrections, PerfModel
from bulletserve.sched.base import AdapterBudget, PlanBuilder, SchedulerSnapshot, SeqView
from bulletserve.sched.bullet.estimates import Estimator
from bulletserve.sched.bullet.params import BulletParams, DeviceTraits
from bulletserve.sched.bullet.rules import RULES, Rule, Situation, choose, fused_rows
from bulletserve.sched.bullet.types import (
    BulletPlan,
    BulletSnapshot,
    LatencyWindow,
    PartitionMode,
    PrefillStep,
    Split,
    UnitSpace,
)
from bulletserve.sched.slo import SLO


@dataclass
class BulletPolicy:
    """`partition`: "auto" (the rules pick the split), "none" (both lanes get every unit, the
    paper's naive ablation) or "static" (a fixed split, its fixed-SM ablation). `rules`: the
    ordered table the split comes from (an ablation passes the table without a rule)."""

    perf: PerfModel
    units: UnitSpace
    num_layers: int
    slo: SLO
    layers_per_step: int | None = None  # None: a prefill runs all layers in one step
    partition: PartitionMode = "auto"
    static_split: Split | None = None
    # Whether a prefill step may carry the decode rows in its own batch (the fused rules).
    fuse_decode: bool = True
    # Under speculative decoding: whether the decode lane verifies only the drafts the draft
    # rule finds worth their cost on the units the split gives it (False: every draft).
    price_drafts: bool = True
    params: BulletParams = field(default_factory=BulletParams)
    rules: tuple[Rule, ...] = RULES
    name: str = "bullet"

    def __post_init__(self) -> None:
        if self.partition not in ("auto", "none", "static"):
            raise ValueError(f"unknown partition mode {self.partition!r}")
        if self.partition == "static":
            split = self.static_split
            if split is None or not (
                self.units.is_valid(split.prefill)
                and self.units.is_valid(split.decode)
                and split.prefill + split.decode == self.units.total
                and split.prefill > 0
                and split.decode > 0
            ):
                raise ValueError(
                    f"static split {split} is not valid for {self.units.total} units "
                    f"(P + D must equal them; granularity {self.units.granularity}, "
                    f"minimum {self.units.minimum})"
                )
        self.traits = DeviceTraits.of(self.perf.hw)
        self.saturation_tokens = self.estimator().saturation_tokens()
        # Where the lanes take turns, nothing runs beside a prefill that a smaller batch would
        # let start sooner, and on the CPUs measured a token kept getting cheaper up to the
        # token budget (SmolLM2 on the AMX Xeon: 0.26 ms at 337 tokens, 0.22 at 923, 0.17 at
        # 2,048) where the quick roofline saw saturation at about 300: a batch is formed up to
        # the token budget, as chunked prefill's.
        self.caps_batch = not self.traits.takes_turns

    def estimator(
        self, corrections: Corrections = Corrections(), decoding: tuple[SeqView, ...] = ()
    ) -> Estimator:
        """Predictions under these corrections, with the decode lane held to the tightest
        TPOT target of the `decoding` requests."""
        targets = [s.slo.tpot_s for s in decoding if s.slo is not None]
        return Estimator(
            self.perf,
            self.units,
            self.slo,
            self.params,
            self.num_layers,
            corrections,
            min(targets) if targets else None,
        )

    def latency_window(self) -> LatencyWindow:
        """The window of recent latencies that the executor feeds and the snapshot carries."""
        return LatencyWindow(self.slo, self.params.stats_window)

    # ---- the two lanes' plans ---------------------------------------------------------------

    def plan_prefill(self, snap: BulletSnapshot) -> BulletPlan:
        """The prefill lane's next step: the next layer group of its batch, or a new batch."""
        est = self.estimator(snap.corrections, snap.decoding)
        if snap.prefill is not None:
            batch, admitted, done = snap.prefill.requests, (), snap.prefill.layers_done
        else:
            batch = self._form_batch(snap, est, saturate=self.caps_batch)
            admitted, done = tuple(s.request_id for s in batch), 0
        step = self._next_step(batch, admitted, done)
        choice = choose(self.situation(snap, batch, step, bool(snap.decoding), est), self.rules)
        fusion = choice.fusion
        if fusion is not None:
            if admitted:
                admitted = tuple(s.request_id for s in fusion.prompts)
            step = PrefillStep(admitted, 0, self.num_layers, fused_rows(snap), fusion.chunk)
        return BulletPlan(choice.split, prefill=step)

    def plan_decode(self, snap: BulletSnapshot) -> BulletPlan:
        """The decode lane's next step: every decoding request, preempting the newest when the
        KV pool runs out; under speculative decoding, with the drafts worth verifying.

        The split is chosen for the rows' own tokens. Drafts then ride only where they raise
        the decode lane's tokens per second on the units it got (`DraftRule`), so the time
        per output token the split was chosen to keep still holds, in expectation."""
        est = self.estimator(snap.corrections, snap.decoding)
        builder = PlanBuilder(
            SchedulerSnapshot(
                now=snap.now,
                waiting=(),
                running=snap.decoding,
                free_blocks=snap.free_blocks,
                block_size=snap.block_size,
                max_num_seqs=max(snap.max_num_seqs, len(snap.decoding)),
                max_num_batched_tokens=len(snap.decoding),
            ),
            # Drafts may take the step up to the token budget.
            token_budget=max(len(snap.decoding), snap.max_prefill_tokens),
        )
        builder.schedule_running(chunk=False)
        # The split must match what the prefill lane can actually run, or both lanes could
        # wait on each other (decode paused for a prefill that cannot be admitted).
        batch = (
            snap.prefill.requests
            if snap.prefill
            else self._form_batch(snap, est, saturate=self.caps_batch)
        )
        done = snap.prefill.layers_done if snap.prefill else 0
        step = self._next_step(batch, (), done)
        situation = self.situation(snap, batch, step, bool(builder.scheduled), est)
        choice = choose(situation, self.rules)
        # The decode lane's units, as the lanes place its step (`LaneCore.placement`); a split
        # that pauses it runs no step, so no drafts. Beside a prefill step, the drafts are
        # priced by the decode step's time beside it.
        split = choice.split
        alone = self.partition == "none" or split.prefill == 0
        units = self.units.total if alone else self.units.total - split.prefill
        if units > 0 and split.decode > 0:
            rule = None
            if self.price_drafts:
                beside = step is not None and not alone
                lens = situation.lens if beside else ()
                rule = est.draft_rule(lens, situation.cached, situation.layers, units)
            builder.add_drafts(rule)
        plan = builder.build()
        return BulletPlan(choice.split, decode=plan.scheduled, preempted=plan.preempted)

    def situation(
        self,
        snap: BulletSnapshot,
        batch: tuple[SeqView, ...],
        step: PrefillStep | None,
        has_decode: bool,
        est: Estimator | None = None,
    ) -> Situation:
        """What the rules decide from, for a lane about to run `step` of `batch`."""
        est = est or self.estimator(snap.corrections, snap.decoding)
        return Situation(
            snap=snap,
            batch=batch,
            step=step,
            has_decode=has_decode,
            est=est,
            traits=self.traits,
            partition=self.partition,
            static_split=self.static_split,
            fuse_decode=self.fuse_decode,
            widen=lambda: self._form_batch(snap, est, saturate=False),
        )

    def _next_step(
        self, batch: tuple[SeqView, ...], admitted: tuple[str, ...], layers_done: int
    ) -> PrefillStep | None:
        if not batch:
            return None
        group = self.layers_per_step or self.num_layers
        return PrefillStep(admitted, layers_done, min(self.num_layers, layers_done + group))

    # ---- the prefill batch ------------------------------------------------------------------

    def order_waiting(self, snap: BulletSnapshot, est: Estimator | None = None) -> list[SeqView]:
        """By priority (lower first; all alike under FCFS), and within one: at-risk requests
        first, earliest deadline (each its own TTFT target) first, then the rest by least
        predicted latency."""
        est = est or self.estimator(snap.corrections, snap.decoding)
        at_risk, rest, lost = [], [], []
        for seq in snap.waiting:  # one prediction each (Estimator.at_risk, past_deadline)
            ttft, target = est.ttft_outlook(seq, snap.now)
            if ttft > target:
                lost.append(seq)
            elif ttft >= est.params.risk_share * target:
                at_risk.append(seq)
            else:
                rest.append(seq)
        at_risk.sort(key=lambda s: s.arrival_time + est.slo_of(s).ttft_s(s.num_tokens))
        rest.sort(key=lambda s: (s.num_remaining, s.arrival_time))
        return sorted(at_risk + rest + lost, key=lambda s: s.priority)

    def _form_batch(
        self, snap: BulletSnapshot, est: Estimator, saturate: bool = True
    ) -> tuple[SeqView, ...]:
        """Whole prompts in order while the batch is below the compute-saturation point (with
        `saturate`: where the lanes share the device) and fits the token, sequence and KV
        budgets, all of one priority (a lower one's tokens would lengthen the step that gives a
        higher one its first token). No overtaking: the first that does not fit ends the
        batch, so an at-risk request is never passed over."""
        batch: list[SeqView] = []
        tokens = 0
        free = snap.free_blocks
        in_flight = snap.prefill.requests if snap.prefill else ()
        adapters = AdapterBudget(snap.max_loras, (*snap.decoding, *in_flight))
        # Keep a block per decoding request free so the decode lane can grow without preempting.
        reserve = min(len(snap.decoding), free)
        seats = snap.max_num_seqs - len(snap.decoding)
        for seq in self.order_waiting(snap, est):
            need = -(-seq.num_tokens // snap.block_size) - seq.num_blocks
            if batch and (
                (saturate and tokens >= self.saturation_tokens)
                or tokens + seq.num_remaining > snap.max_prefill_tokens
                or seq.priority != batch[0].priority
            ):
                break
            if seats <= 0 or need > free - reserve or not adapters.admits(seq):
                break
            adapters.add(seq)
            batch.append(seq)
            tokens += seq.num_remaining
            free -= need
            seats -= 1
        return tuple(batch)
