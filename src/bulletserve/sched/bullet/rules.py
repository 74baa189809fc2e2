"""Bullet's split as an ordered table of rules: the first rule whose condition holds chooses the
split (and, for the fused rules, the fused step). Each rule is tagged with where it comes from:
the paper's Algorithm 1, one of its ablations, or an extension of ours; docs/bullet-rules.md
gives each extension's evidence and the experiment that would remove it. The last rule always
fires.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from bulletserve.sched.base import ScheduledSeq, SeqView
from bulletserve.sched.bullet.estimates import Estimator
from bulletserve.sched.bullet.params import DeviceTraits
from bulletserve.sched.bullet.types import (
    BulletSnapshot,
    Fusion,
    PartitionMode,
    PrefillStep,
    Split,
)

Origin = Literal["Algorithm 1", "ablation", "extension"]


@dataclass
class Situation:
    """One split decision's inputs: the snapshot, the prefill batch and step the prefill lane
    can run next, and whether decode has rows. What the rules derive from them is computed on
    first use, once per decision."""

    snap: BulletSnapshot
    batch: tuple[SeqView, ...]
    step: PrefillStep | None
    has_decode: bool
    est: Estimator
    traits: DeviceTraits
    partition: PartitionMode
    static_split: Split | None
    fuse_decode: bool
    # The batch without the compute-saturation cap (chunked prefill's, up to the token
    # budget), formed only if a rule asks (None: the batch itself).
    widen: Callable[[], tuple[SeqView, ...]] | None = None

    @property
    def total(self) -> int:
        return self.est.units.total

    @cached_property
    def tpot_ok(self) -> bool:
        p90 = self.snap.stats.p90_tpot_over_slo
        return p90 is None or p90 <= 1.0

    @cached_property
    def risky(self) -> bool:
        """Whether a prompt of the batch is at risk of missing its TTFT. TTFT counts as missing
        then, not only when recent first tokens missed: otherwise, while TPOT misses, decode
        would take unit after unit until prefill had none, and no first token (the only TTFT
        evidence) would come."""
        return any(self.est.at_risk(s, self.snap.now) for s in self.batch)

    @cached_property
    def outranked(self) -> bool:
        """Decoding requests behind their own TPOT target (Estimator.behind_tpot) outrank every
        prompt of the batch (by priority, then the tighter TPOT target): a step that carries
        the prompts would lengthen the TPOT of requests that come first. With one SLO and one
        priority no request outranks another, and this never holds."""
        if not self.batch:
            return False
        est, now = self.est, self.snap.now
        first_prompt = min(map(est.rank, self.batch))
        return any(
            est.rank(s) < first_prompt and est.behind_tpot(s, now) for s in self.snap.decoding
        )

    @cached_property
    def ttft_ok(self) -> bool:
        p90 = self.snap.stats.p90_ttft_over_slo
        return not self.risky and (p90 is None or p90 <= 1.0)

    @cached_property
    def lens(self) -> tuple[int, ...]:
        return tuple(s.num_remaining for s in self.batch)

    @cached_property
    def cached(self) -> tuple[int, ...]:
        return tuple(s.num_computed_tokens for s in self.batch)

    @cached_property
    def decode_ctx(self) -> tuple[int, ...]:
        """The decode batch to size decode's units for: the decoding requests, and the batch's
        prompts when this step completes them (decode ramps up near the end of a prefill)."""
        ctx = tuple(s.num_tokens for s in self.snap.decoding)
        if self.step is not None and self.step.layer_end >= self.est.num_layers:
            ctx += tuple(s.num_tokens + 1 for s in self.batch)
        return ctx

    @property
    def layers(self) -> int:
        step = self.step
        return (step.layer_end - step.layer_start) if step else self.est.num_layers

    @cached_property
    def fewest_decode_units(self) -> int:
        return self.est.fewest_decode_units(self.lens, self.cached, self.decode_ctx, self.layers)

    @cached_property
    def shares(self) -> float:
        """The lanes side by side against taking turns (Estimator.co_running_shares)."""
        remaining = self.est.num_layers - (self.step.layer_start if self.step else 0)
        return self.est.co_running_shares(
            self.snap.now,
            self.batch,
            self.lens,
            self.cached,
            self.decode_ctx,
            self.layers,
            remaining,
            self.fewest_decode_units,
        )

    @cached_property
    def model_off(self) -> bool:
        """The performance model's recent predictions are off by more than the bound."""
        error = self.snap.stats.model_error
        return error is not None and error > self.est.params.model_error_bound

    @property
    def _may_fuse(self) -> bool:
        """A fused step can run: fusing is on, and the next step is a whole pass that no
        running step has begun (its decode rows run every layer in it)."""
        step, snap = self.step, self.snap
        return (
            self.fuse_decode
            and step is not None
            and step.layer_start == 0
            and step.layer_end == self.est.num_layers
            and not (snap.prefill is not None and snap.prefill.stepping)
        )

    @cached_property
    def chunked_fusion(self) -> Fusion | None:
        """The step chunked prefill would run now, as a fused step: every decoding request's
        next token and the prompts from the front (of the batch without the saturation cap)
        whose tokens fit the token budget beside those rows, or a chunk of the first prompt
        that fills it. None where a fused step cannot run."""
        if not self._may_fuse or not self.snap.decoding:
            return None
        snap = self.snap
        batch = self.widen() if self.widen is not None and snap.prefill is None else self.batch
        if not batch:
            return None
        decode_ctx = tuple(s.num_tokens for s in snap.decoding)
        if snap.prefill is not None and len(batch) > 1:
            # A batch already admitted runs whole: only a batch of one prompt is chunked.
            return self.est.fused_step(batch, None, decode_ctx)
        granule = self.est.params.chunk_granule
        room = max((snap.max_prefill_tokens - len(decode_ctx)) // granule * granule, granule)
        count, tokens = 0, 0
        for seq in batch:
            if tokens + seq.num_remaining > room:
                break
            count, tokens = count + 1, tokens + seq.num_remaining
        if count:
            return self.est.fused_step(batch[:count], None, decode_ctx)
        # The first prompt alone is over the budget: a chunk of it that fills the budget.
        return self.est.fused_step(batch[:1], room, decode_ctx)

    @cached_property
    def fusion(self) -> Fusion | None:
        """The fused step to weigh against the other ways of running, or None where fusing is
        off or cannot be done: the decode rows run every layer in the step, so it must be a
        whole pass that no running step has begun. (The KV blocks of the rows' next tokens are
        there: batches are formed only beside a free block per decoding request.) It takes the
        most of the batch that fits the TPOT budget, or 1.5x the SLO while TTFT misses and TPOT
        holds; where not even a chunk fits, the whole batch on a device whose lanes take turns
        (decode waits out the prefill anyway), none on one whose lanes share."""
        if not self._may_fuse:
            return None
        snap, est = self.snap, self.est
        decode_ctx = tuple(s.num_tokens for s in snap.decoding)
        budget = est.tpot_budget_s
        limit = est.tpot_s * est.params.late_fused_step_limit if self._late else budget
        whole = est.fused_step(self.batch, None, decode_ctx)
        fits = est.longest_fitting_step(self.batch, whole, decode_ctx, limit)
        if fits is not None:
            return dataclasses.replace(fits, ttft_first=fits.seconds > budget)
        return whole if self.traits.takes_turns else None

    @property
    def _late(self) -> bool:
        """TTFT misses (a prompt of the batch at risk, or recent first tokens late) while recent
        TPOT holds: a request's TPOT is the mean of the steps it rides in, and the decode-only
        steps between fused ones are shorter than the SLO."""
        stats = self.snap.stats
        if stats.p90_tpot_over_slo is None or stats.p90_tpot_over_slo > 1.0:
            return False
        late_ttft = stats.p90_ttft_over_slo is not None and stats.p90_ttft_over_slo > 1.0
        return self.risky or late_ttft

    @cached_property
    def winning_fusion(self) -> Fusion | None:
        """The fused step where it does more work a second than both taking turns (1.0) and
        the lanes side by side."""
        fusion = self.fusion
        if fusion is not None and fusion.gain > 1.0 and fusion.gain > self.shares:
            return fusion
        return None


@dataclass(frozen=True)
class Choice:
    split: Split
    fusion: Fusion | None = None  # the fused step, for the fused rules


@dataclass(frozen=True)
class Rule:
    name: str
    origin: Origin
    summary: str
    decide: Callable[[Situation], Choice | None]


def _split(prefill: int, decode: int, rule: str) -> Choice:
    return Choice(Split(prefill, decode, rule))


def _none(s: Situation) -> Choice | None:
    return _split(s.total, s.total, "none") if s.partition == "none" else None


def _no_prefill(s: Situation) -> Choice | None:
    return None if s.batch else _split(0, s.total, "no-prefill")


def _no_decode(s: Situation) -> Choice | None:
    return None if s.has_decode else _split(s.total, 0, "no-decode")


def _static(s: Situation) -> Choice | None:
    if s.partition != "static":
        return None
    assert s.static_split is not None  # the policy checks it
    return Choice(s.static_split)


def _decode_first(s: Situation) -> Choice | None:
    """Where the lanes take turns, a step either carries prompts or not: while requests behind
    their TPOT target outrank every queued prompt and none of those is at risk, the decode rows
    run alone (where the lanes share, the split rules give decode more units instead)."""
    if not (s.traits.takes_turns and s.has_decode) or s.model_off:
        return None
    return _split(0, s.total, "decode-first") if s.outranked and not s.risky else None


def _chunked_plan(s: Situation) -> Choice | None:
    """Chunked prefill's plan (prompts up to the token budget fused with the decode rows, as a
    chunked engine's hybrid step) where the model is not trusted (its recent predictions are
    off beyond the bound), and on a device whose lanes take turns unless TPOT misses while TTFT
    holds: there the lanes cannot gain by sharing, and a step smaller than chunked's leaves
    prompts waiting while TPOT has room; TPOT missing is what shrinks the steps (the fused
    rules size them to its budget)."""
    turns_plan = s.traits.takes_turns and (s.tpot_ok or not s.ttft_ok)
    if not (s.model_off or turns_plan):
        return None
    fusion = s.chunked_fusion
    return None if fusion is None else Choice(Split(s.total, 0, "chunked-plan"), fusion)


def _fused_ttft_first(s: Situation) -> Choice | None:
    fusion = s.winning_fusion
    if fusion is None or not fusion.ttft_first:
        return None
    return Choice(Split(s.total, 0, "fused-ttft-first"), fusion)


def _fused(s: Situation) -> Choice | None:
    fusion = s.winning_fusion
    if fusion is None or fusion.ttft_first:
        return None
    return Choice(Split(s.total, 0, "fused"), fusion)


def _turns(s: Situation) -> Choice | None:
    if s.traits.takes_turns and s.shares <= 1.0:
        return _split(s.total, 0, "turns")
    return None


def _at_risk_first(s: Situation) -> Choice | None:
    if not (s.tpot_ok and s.risky):
        return None
    if not s.est.decode_can_pause(s.lens, s.cached, s.decode_ctx, s.layers):
        return None
    return _split(s.total, 0, "at-risk-first")


def _decode_gets(s: Situation, decode_units: int, rule: str) -> Choice:
    """Decode on `decode_units`, prefill on the rest; every unit to decode when the rest would
    be too few to run a prefill on."""
    if s.total - decode_units < s.est.units.least_remainder:
        decode_units = s.total
    return _split(s.total - decode_units, decode_units, rule)


def _balance(s: Situation) -> Choice | None:
    if s.ttft_ok or s.tpot_ok:
        return None
    units = s.est.units
    return _decode_gets(s, units.round_down(s.total // 2) or units.counts()[0], "balance")


def _decode_fewest(s: Situation) -> Choice | None:
    return _decode_gets(s, s.fewest_decode_units, "decode-fewest") if s.tpot_ok else None


def _decode_grows(s: Situation) -> Choice:
    units = s.est.units
    grown = units.round_down(s.snap.split.decode + units.granularity)
    return _decode_gets(s, min(s.total, max(s.fewest_decode_units, grown)), "decode-grows")


RULES: tuple[Rule, ...] = (
    Rule("none", "ablation", "--partition none: both lanes on every unit", _none),
    Rule("no-prefill", "Algorithm 1", "nothing to prefill: decode gets every unit", _no_prefill),
    Rule("no-decode", "Algorithm 1", "nothing to decode: prefill gets every unit", _no_decode),
    Rule("static", "ablation", "--partition static:P/D: a fixed split", _static),
    Rule(
        "decode-first",
        "extension",
        "the lanes take turns and requests behind their TPOT target outrank every queued "
        "prompt, none at risk: the decode rows alone",
        _decode_first,
    ),
    Rule(
        "chunked-plan",
        "extension",
        "the model is off, or the lanes take turns and TPOT holds (or TTFT misses): chunked "
        "prefill's step, prompts up to the token budget fused with the decode rows",
        _chunked_plan,
    ),
    Rule(
        "fused-ttft-first",
        "extension",
        "TTFT misses and TPOT holds: the decode rows ride in a prefill step longer than the "
        "TPOT budget",
        _fused_ttft_first,
    ),
    Rule(
        "fused",
        "extension",
        "fusing does the most work a second: the decode rows ride in the prefill's step",
        _fused,
    ),
    Rule(
        "turns",
        "extension",
        "the lanes side by side do no more work a second than in turns: prefill first, alone",
        _turns,
    ),
    Rule(
        "at-risk-first",
        "Algorithm 1",
        "a prompt at risk takes every unit while decode can wait out the step within a TPOT",
        _at_risk_first,
    ),
    Rule("balance", "extension", "TTFT and TPOT both missing: half the units each", _balance),
    Rule(
        "decode-fewest",
        "Algorithm 1",
        "TPOT holds: decode gets the fewest units that keep it",
        _decode_fewest,
    ),
    Rule("decode-grows", "Algorithm 1", "TPOT misses: decode grows by a granule", _decode_grows),
)
RULE_NAMES: tuple[str, ...] = tuple(rule.name for rule in RULES)


def choose(situation: Situation, rules: tuple[Rule, ...] = RULES) -> Choice:
    """The choice of the first rule that fires."""
    for rule in rules:
        choice = rule.decide(situation)
        if choice is not None:
            return choice
    raise RuntimeError(f"no rule of {[r.name for r in rules]} fired: the last must always fire")


def fused_rows(snap: BulletSnapshot) -> tuple[ScheduledSeq, ...]:
    """The decode rows a fused step carries: a token of every decoding request."""
    return tuple(ScheduledSeq(s.request_id, 1) for s in snap.decoding)
