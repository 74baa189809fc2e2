"""Bullet's SLO-aware scheduler (Algorithm 1 of arXiv 2504.19516), pure.

Two lanes run at once: a prefill lane (whole prompts, possibly in layer groups) and a decode
lane (every decoding request, one token per step). Each lane asks for a plan at the start of its
step; the plan says what the lane runs and how the device's units are split between the lanes.
Decisions come from the snapshot and the performance model's predictions only.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

from bulletserve.perf.model import PerfModel
from bulletserve.perf.state import ExecutionState, fused_step_state
from bulletserve.sched.base import PlanBuilder, ScheduledSeq, SchedulerSnapshot, SeqView

# A request is at risk when the time it has waited plus its predicted prefill reaches this share
# of its TTFT budget: it then goes first, and is never passed over.
RISK_SHARE = 0.7
# Decode gets units for a predicted step time within this share of the TPOT SLO.
TPOT_HEADROOM = 0.8
STATS_WINDOW = 64  # recent requests behind the P90 TTFT and TPOT the scheduler sees
# A prompt too long for a fused step within the TPOT budget rides in chunks of a multiple of
# this many tokens (its last chunk: what is left).
CHUNK_GRANULE = 64
# While TTFT misses its SLO and P90 TPOT holds, a fused step may take up to this multiple of the
# TPOT SLO (else TPOT_HEADROOM of it). Simulated on the A100 preset, 1000 requests, seeds 0-2, at
# the capacity edges: 1.0 lost arxiv-sum-like at 4 req/s (median 79.4% against 92.7% with no
# limit), no limit lost azure-code-like at 6.25 (88.5% against 91.1% never outlasting the
# budget); 1.5 kept both (94.1%, 90.6%).
LATE_FUSED_STEP_LIMIT = 1.5
# The rules of `BulletPolicy.choose_split`, as a split (and the step log) names them.
SPLIT_RULES = {
    "none": "--partition none: both lanes on every unit",
    "static": "--partition static:P/D",
    "no-prefill": "nothing to prefill: decode gets every unit",
    "no-decode": "nothing to decode: prefill gets every unit",
    "cpu-fused": "CPU, fusing pays most: the decode rows ride in the prefill's step",
    "fused": "GPU, fusing pays most and fits the TPOT budget: the rows ride in the prefill's step",
    "fused-ttft-first": "TTFT misses and TPOT holds: the whole batch fuses, past the TPOT budget",
    "cpu-turns": "CPU, co-running does not pay: the lanes take turns, prefill first",
    "at-risk-first": "an at-risk prefill takes the device; decode waits within one TPOT",
    "balance": "TTFT and TPOT both missing: half the units each",
    "decode-fewest": "TPOT holds: decode gets the fewest units that keep it",
    "decode-grows": "TPOT missing: decode grows by a granule",
}


@dataclass(frozen=True)
class Split:
    """Units per lane. 0 pauses a lane; with partitioning off both lanes get every unit.
    `rule` names the rule of `BulletPolicy.choose_split` that chose it, for the step log; it
    does not take part in comparisons."""

    prefill: int
    decode: int
    rule: str = field(default="", compare=False)


@dataclass(frozen=True)
class UnitSpace:
    """The device's compute units: how many, and which counts a lane may get."""

    total: int
    granularity: int
    minimum: int
    # The fewest units a lane may run on when they are what is left beside a carved group
    # (None: `minimum`); the GPU partitioner sets it (see partition/cuda.py for why).
    min_remainder: int | None = None

    def counts(self) -> list[int]:
        """Unit counts a lane may be given as a carved group, ascending."""
        start = math.ceil(self.minimum / self.granularity) * self.granularity
        valid = set(range(start, self.total + 1, self.granularity)) | {self.total}
        return sorted(c for c in valid if c >= self.minimum)

    @property
    def least_remainder(self) -> int:
        """Fewest units a lane may run on beside a carved group."""
        return max(self.minimum, self.min_remainder or 0)

    def is_valid(self, units: int) -> bool:
        """0 (paused), a carved group, or what is left beside one (e.g. 124 of 132 SMs)."""
        if units == 0:
            return True
        carved = self.counts()
        return units in carved or (units >= self.least_remainder and self.total - units in carved)


@dataclass(frozen=True)
class Slo:
    """A prompt of n tokens should see its first token within ttft_base_s + n *
    ttft_per_token_s (the paper's SLO has no fixed part), and each later one within tpot_s."""

    ttft_per_token_s: float
    tpot_s: float
    ttft_base_s: float = 0.0

    def ttft_s(self, prompt_tokens: int) -> float:
        return self.ttft_base_s + self.ttft_per_token_s * prompt_tokens


@dataclass(frozen=True)
class LatencyStats:
    """P90s over a sliding window of recent requests; None until there is data."""

    p90_ttft_over_slo: float | None = None  # TTFT as a fraction of the request's TTFT SLO
    p90_tpot_s: float | None = None


class LatencyWindow:
    """P90 TTFT (over each request's own TTFT SLO) over the last STATS_WINDOW first tokens and
    P90 TPOT over the last STATS_WINDOW finished requests; the engine and the simulator feed
    it the same way. TTFT is counted when the first token comes, not when the request ends:
    with outputs of hundreds of tokens the window would otherwise report the TTFT of requests
    that arrived many seconds ago, and a prefill starved since would go unseen."""

    def __init__(self, slo: Slo) -> None:
        self.slo = slo
        self.ttft_over_slo: deque[float] = deque(maxlen=STATS_WINDOW)
        self.tpot: deque[float] = deque(maxlen=STATS_WINDOW)

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self.ttft_over_slo.append(ttft_s / self.slo.ttft_s(prompt_tokens))

    def finished(self, tpot_s: float | None) -> None:
        """A request ended; tpot_s is None when it produced a single token."""
        if tpot_s is not None:
            self.tpot.append(tpot_s)

    def stats(self) -> LatencyStats:
        return LatencyStats(_p90(self.ttft_over_slo), _p90(self.tpot))


def _p90(values: deque[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def parse_partition(text: str, total_units: int | None = None) -> tuple[str, Split | None]:
    """`--partition auto|none|static:P/D` -> (mode, static split); P + D is checked against
    the device when its unit count is known."""
    if text in ("auto", "none"):
        return text, None
    try:
        if not text.startswith("static:"):
            raise ValueError
        prefill, decode = (int(x) for x in text.removeprefix("static:").split("/"))
    except ValueError:
        raise ValueError(f"--partition must be auto, none or static:P/D, not {text!r}") from None
    if total_units is not None and prefill + decode > total_units:
        raise ValueError(f"--partition {text}: P + D exceeds the device's {total_units} units")
    return "static", Split(prefill, decode, "static")


@dataclass(frozen=True)
class PrefillInFlight:
    """The prefill lane's current batch, how many layers of its current pass it has run, and
    whether a step of it is running now. A batch whose prompt has computed some chunks and has
    more to go is in flight with `layers_done` 0 between its steps."""

    requests: tuple[SeqView, ...]
    layers_done: int
    stepping: bool = False


@dataclass(frozen=True)
class BulletSnapshot:
    now: float
    waiting: tuple[SeqView, ...]
    prefill: PrefillInFlight | None
    decoding: tuple[SeqView, ...]
    free_blocks: int
    block_size: int
    max_num_seqs: int
    max_prefill_tokens: int
    stats: LatencyStats
    split: Split  # the split in force


@dataclass(frozen=True)
class PrefillStep:
    """Run layers [layer_start, layer_end) of the batch; `admitted` is non-empty when the step
    starts a new batch from the waiting queue. `decode` holds the decoding requests whose next
    token the step computes too, fused into its batch (rules `cpu-fused`, `fused`); the decode
    lane pauses meanwhile. `chunk` is set when the step computes only the next `chunk` tokens
    of the batch's one prompt (a fused step that would not fit the TPOT budget whole); the
    prompt stays in the prefill lane until its last chunk."""

    admitted: tuple[str, ...]
    layer_start: int
    layer_end: int
    decode: tuple[ScheduledSeq, ...] = ()
    chunk: int | None = None


@dataclass(frozen=True)
class Fusion:
    """A fused step the policy could run: its prompts (the batch, its first few, or its first
    alone), the chunk of that prompt (None: every prompt's rest), its work per second against a
    prefill step and a decode step one after the other (`gain`), its predicted time, and
    whether it may outlast the TPOT budget because TTFT misses while TPOT holds (`ttft_first`)."""

    prompts: tuple[SeqView, ...]
    chunk: int | None
    gain: float
    seconds: float
    ttft_first: bool = False


@dataclass(frozen=True)
class BulletPlan:
    split: Split
    prefill: PrefillStep | None = None
    decode: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[str, ...] = ()


@dataclass
class BulletPolicy:
    """`partition`: "auto" (the policy picks the split), "none" (both lanes get every unit,
    the paper's naive ablation) or "static" (a fixed split, its fixed-SM ablation)."""

    perf: PerfModel
    units: UnitSpace
    num_layers: int
    slo: Slo
    layers_per_step: int | None = None  # None: a prefill runs all layers in one step
    partition: str = "auto"
    static_split: Split | None = None
    # Whether a prefill step may carry the decode rows in its own batch (`cpu-fused`, `fused`)
    # where the performance model says that does more work per second than the alternatives.
    fuse_decode: bool = True
    name: str = "bullet"

    def __post_init__(self) -> None:
        if self.partition not in ("auto", "none", "static"):
            raise ValueError(f"unknown partition mode {self.partition!r}")
        if self.partition == "static":
            split = self.static_split
            if split is None or not (
                self.units.is_valid(split.prefill)
                and self.units.is_valid(split.decode)
                and split.prefill + split.decode <= self.units.total
                and split.prefill > 0
                and split.decode > 0
            ):
                raise ValueError(
                    f"static split {split} is not valid for {self.units.total} units "
                    f"(granularity {self.units.granularity}, minimum {self.units.minimum})"
                )
        self.saturation_tokens = self._saturation_tokens()

    # ---- the two lanes' plans ---------------------------------------------------------------

    def plan_prefill(self, snap: BulletSnapshot) -> BulletPlan:
        """The prefill lane's next step: the next layer group of its batch, or a new batch."""
        if snap.prefill is not None:
            batch, admitted, done = snap.prefill.requests, (), snap.prefill.layers_done
        else:
            batch = self._form_batch(snap)
            admitted, done = tuple(s.request_id for s in batch), 0
        step = None
        if batch:
            group = self.layers_per_step or self.num_layers
            step = PrefillStep(admitted, done, min(self.num_layers, done + group))
        split, fusion = self._decide(snap, batch, step)
        if fusion is not None:
            rows = tuple(ScheduledSeq(s.request_id, 1) for s in snap.decoding)
            if admitted:
                admitted = tuple(s.request_id for s in fusion.prompts)
            step = PrefillStep(admitted, 0, self.num_layers, rows, fusion.chunk)
        return BulletPlan(split, prefill=step)

    def plan_decode(self, snap: BulletSnapshot) -> BulletPlan:
        """The decode lane's next step: every decoding request, preempting the newest when the
        KV pool runs out."""
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
            token_budget=len(snap.decoding),
        )
        builder.schedule_running(chunk=False)
        plan = builder.build()
        # The split must match what the prefill lane can actually run, or both lanes could
        # wait on each other (decode paused for a prefill that cannot be admitted).
        batch = snap.prefill.requests if snap.prefill else self._form_batch(snap)
        done = snap.prefill.layers_done if snap.prefill else 0
        step = None
        if batch:
            group = self.layers_per_step or self.num_layers
            step = PrefillStep((), done, min(self.num_layers, done + group))
        return BulletPlan(
            self.choose_split(snap, batch, step, decode=plan.scheduled),
            decode=plan.scheduled,
            preempted=plan.preempted,
        )

    # ---- the split --------------------------------------------------------------------------

    def choose_split(
        self,
        snap: BulletSnapshot,
        prefill_batch: tuple[SeqView, ...],
        step: PrefillStep | None,
        decode: tuple[ScheduledSeq, ...] | None = None,
    ) -> Split:
        return self._decide(snap, prefill_batch, step, decode)[0]

    def _decide(
        self,
        snap: BulletSnapshot,
        prefill_batch: tuple[SeqView, ...],
        step: PrefillStep | None,
        decode: tuple[ScheduledSeq, ...] | None = None,
    ) -> tuple[Split, Fusion | None]:
        """The split, and the fused step when the rule is `cpu-fused` or `fused`."""
        total = self.units.total
        if self.partition == "none":
            return Split(total, total, "none"), None
        has_prefill = bool(prefill_batch)
        has_decode = bool(snap.decoding) if decode is None else bool(decode)
        if not has_prefill:
            return Split(0, total, "no-prefill"), None
        if not has_decode:
            return Split(total, 0, "no-decode"), None
        if self.partition == "static":
            return self.static_split, None
        stats, slo = snap.stats, self.slo
        tpot_ok = stats.p90_tpot_s is None or stats.p90_tpot_s <= slo.tpot_s
        # TTFT misses its SLO when recent first tokens did, or when a prompt that waits now is
        # at risk: otherwise, while TPOT is over its SLO, decode would take unit after unit
        # until prefill had none, and no first token (the only TTFT evidence) would come.
        risky = any(self.at_risk(s, snap.now) for s in prefill_batch)
        decode_ctx = tuple(s.num_tokens for s in snap.decoding)
        lens = tuple(s.num_remaining for s in prefill_batch)
        cached = tuple(s.num_computed_tokens for s in prefill_batch)
        layers = (step.layer_end - step.layer_start) if step else self.num_layers
        if step is not None and step.layer_end >= self.num_layers:
            # The batch joins decode after this step: size decode for the batch it will have.
            decode_ctx += tuple(s.num_tokens + 1 for s in prefill_batch)
        # On a GPU the lanes gain from running together, so only an at-risk prefill pauses
        # decode, and only when decode can wait out the step within one TPOT. On a CPU a lane
        # has a few threads to give, and whether splitting them gains depends on the CPU: where
        # each lane keeps more than its share of its speed alone (2 AMD Zen 3 vCPUs in fp32: a
        # decode step as fast on one thread as on two, docs/data/cpu-profile-2026-11-30m.json)
        # the lanes share the CPU whether TPOT holds or not; where splitting is zero-sum or
        # worse (one thread of two running a prefill at half speed, a 50-row decode on the
        # other at 180 ms against 76 ms on both: bench-cpu-22, an AMX Xeon) they take turns on
        # the whole CPU, prefill first. (Letting decode go first while TPOT missed and TTFT held
        # did not pay: bullet then lost to prefill-first under overload, 0.55 against 0.73 at
        # 5.5 req/s in bench-cpu-27. The rule before this one gave a prefill every thread while
        # TPOT held, whatever the profile said, from sweeps on an AMX Xeon whose profile also
        # predicts sharing to gain: there this rule shares more than it did, which no sweep on
        # that machine has measured.) Where a prefill runs on every thread anyway, the decode
        # rows can ride in its batch: a row in the prefill's GEMMs costs about 2 ms where a
        # separate decode step streams every weight again (41-69 ms, bench-cpu-53), so the
        # three ways (turns, side by side, fused) are compared by the work they do a second.
        if self.perf.hw.kind == "cpu":
            remaining = self.num_layers - (step.layer_start if step else 0)
            shares = self._co_running_shares(
                snap.now, prefill_batch, lens, cached, decode_ctx, layers, remaining
            )
            fusion = self._fusion(snap, prefill_batch, step, risky)
            if fusion is not None and fusion.gain > max(1.0, shares):
                return Split(total, 0, _fused_rule(fusion, "cpu-fused")), fusion
            if shares <= 1.0:
                return Split(total, 0, "cpu-turns"), None
        else:
            # On a GPU a small prefill beside a big decode batch gains little from SMs of its
            # own: the decode step is bound by memory bandwidth, and the prompt's tokens ride
            # in its GEMMs almost for free, as in a chunked-prefill hybrid batch. Simulated on
            # the A100 preset, sharegpt-like at 28 req/s, 1000 requests, seed 0: with the rows fused
            # where that does the most work a second, 94.9% attainment against 77.3% without
            # (prefill and decode otherwise took turns on the whole GPU at the 256-sequence
            # cap). Unlike taking turns on a CPU, the alternative here keeps decode stepping
            # beside the prefill, so a fused step must also fit in the TPOT budget: a prompt
            # too long for that rides in chunks, as in chunked prefill. (Simulated on the
            # H200's measured profile, arxiv-sum-like, whole prompts that could not fuse ran
            # beside decode at about 1 s a step while the queue built.)
            fusion = self._fusion(snap, prefill_batch, step, risky)
            if fusion is not None and fusion.gain > 1.0:
                remaining = self.num_layers - (step.layer_start if step else 0)
                shares = self._co_running_shares(
                    snap.now, prefill_batch, lens, cached, decode_ctx, layers, remaining
                )
                if fusion.gain > shares:
                    return Split(total, 0, _fused_rule(fusion, "fused")), fusion
        ttft_ok = not risky and (stats.p90_ttft_over_slo is None or stats.p90_ttft_over_slo <= 1.0)
        if tpot_ok and risky and self._decode_can_pause(lens, cached, decode_ctx, layers):
            return Split(total, 0, "at-risk-first"), None
        if not ttft_ok and not tpot_ok:
            rule = "balance"
            decode_units = self._round_down(total // 2) or self.units.counts()[0]
        else:
            d_min = self._fewest_decode_units(lens, cached, decode_ctx, layers)
            if tpot_ok:
                rule, decode_units = "decode-fewest", d_min
            else:
                grown = snap.split.decode + self.units.granularity
                rule, decode_units = "decode-grows", min(total, max(d_min, self._round_down(grown)))
        if total - decode_units < self.units.least_remainder:
            decode_units = total  # too little would be left to run a prefill on
        return Split(total - decode_units, decode_units, rule), None

    def _fewest_decode_units(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
    ) -> int:
        """Fewest units that keep the co-running decode step within the TPOT SLO and that
        it does not outlast the prefill step beside it (leaving the prefill lane at least its
        minimum); all but the minimum when none does.

        A step keeps its units until it ends, so a decode step squeezed onto the fewest units
        that keep TPOT beside a short prefill (one prompt, a few ms) runs for most of a TPOT
        after the prefill's units have gone idle: simulated on an A100, 20 req/s of
        sharegpt-like left the prefill lane 19% busy while 250-sequence decode steps took
        115 ms on 20 of 108 SMs (25 ms on all 108)."""
        counts = self.units.counts()
        budget = self.slo.tpot_s * TPOT_HEADROOM
        candidates = [d for d in counts if self.units.total - d >= self.units.least_remainder]
        keeps_tpot = False  # decode_s falls as d grows: once true, true for every larger d
        for d in candidates:
            es = ExecutionState(
                prefill_lens=prefill_lens,
                prefill_cached=_cached(cached),
                prefill_units=self.units.total - d,
                decode_ctx=decode_ctx,
                decode_units=d,
                prefill_layers=layers,
            )
            prediction = self.perf.predict(es)
            keeps_tpot = keeps_tpot or prediction.decode_s <= budget
            if keeps_tpot and prediction.decode_s <= prediction.prefill_s:
                return d
        return candidates[-1] if candidates else counts[0]

    def _co_running_shares(
        self,
        now: float,
        batch: tuple[SeqView, ...],
        lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
        remaining_layers: int,
    ) -> float:
        """The work per second of the prefill beside a stream of decode steps, on the split that
        the rules below would give decode, against the lanes taking turns on every unit (1.0);
        0.0 when decode would leave prefill no unit or a prompt of the batch would reach the
        at-risk share of its TTFT budget at the slower side-by-side speed.

        Each lane side by side runs at some share of its speed alone on every unit; the decode
        lane keeps stepping while the prefill runs, so sharing gains where the two shares sum
        past 1 (taking turns, they sum to exactly 1). Where one thread has most of the
        bandwidth, the decode share is near 1: the profile of 2 Zen 3 vCPUs in fp32
        (docs/data/cpu-profile-2026-11-30m.json) gives a 100-token prefill 0.62 of its speed on
        one thread beside a 16-row decode and the decode 0.85 of its own, 1.47 in all. Where
        the threads split compute and bandwidth evenly, the shares sum to about 1."""
        total = self.units.total
        d = self._fewest_decode_units(lens, cached, decode_ctx, layers)
        if total - d <= 0:
            return 0.0
        side_by_side = self.perf.predict(
            ExecutionState(
                prefill_lens=lens,
                prefill_cached=_cached(cached),
                prefill_units=total - d,
                decode_ctx=decode_ctx,
                decode_units=d,
                prefill_layers=layers,
            )
        )
        prefill_left_s = side_by_side.prefill_s * remaining_layers / layers
        in_time = all(
            now - s.arrival_time + prefill_left_s < RISK_SHARE * self.slo.ttft_s(s.num_remaining)
            for s in batch
        )
        if not in_time:
            return 0.0
        prefill_alone, decode_alone = self._alone_s(lens, cached, decode_ctx, layers)
        return prefill_alone / side_by_side.prefill_s + decode_alone / side_by_side.decode_s

    def _fusion(
        self,
        snap: BulletSnapshot,
        batch: tuple[SeqView, ...],
        step: PrefillStep | None,
        risky: bool,
    ) -> Fusion | None:
        """The fused step to weigh against the lanes' other ways of running, or None where
        fusing is off or cannot be done: the decode rows must run every layer in the step, so
        the step must run all layers of a pass that no running step has begun. (The KV blocks
        of the rows' next tokens are there: `_form_batch` admits prompts only beside a free
        block per decoding request.) The most of the batch that fits the TPOT budget (see
        `_longest_fitting_step`), a longer limit while TTFT misses and TPOT holds; where not
        even a chunk fits, on a CPU, where the alternative (turns) pauses decode for the whole
        prefill anyway, the whole batch, and on a GPU, where decode keeps stepping beside a
        prefill, none.
        `risky`: whether a prompt of the batch is at risk. `choose_split` asks only under `auto`,
        with both phases waiting."""
        if (
            not self.fuse_decode
            or step is None
            or step.layer_start != 0
            or step.layer_end != self.num_layers
            or (snap.prefill is not None and snap.prefill.stepping)
        ):
            return None
        decode_ctx = tuple(s.num_tokens for s in snap.decoding)
        budget = self.slo.tpot_s * TPOT_HEADROOM
        late = self._prefill_late_tpot_holds(snap.stats, risky)
        limit = self.slo.tpot_s * LATE_FUSED_STEP_LIMIT if late else budget
        whole = self._fused_step(batch, None, decode_ctx)
        fits = self._longest_fitting_step(batch, whole, decode_ctx, limit)
        if fits is not None:
            return dataclasses.replace(fits, ttft_first=fits.seconds > budget)
        return whole if self.perf.hw.kind == "cpu" else None

    def _longest_fitting_step(
        self,
        batch: tuple[SeqView, ...],
        whole: Fusion,
        decode_ctx: tuple[int, ...],
        limit_s: float,
    ) -> Fusion | None:
        """The fused step with the most prompt tokens from the batch's front that the model
        predicts within `limit_s`: the whole batch (`whole`); else the most whole prompts from
        its front (the decode rows cost the same however few prompt tokens ride with them, so a
        step of the first prompt alone, the shortest waiting, would spend its time on decode);
        else the longest chunk of the first prompt, in CHUNK_GRANULE tokens; else None."""
        if whole.seconds <= limit_s:
            return whole
        fits = None
        for count in range(1, len(batch)):
            candidate = self._fused_step(batch[:count], None, decode_ctx)
            if candidate.seconds > limit_s:
                break
            fits = candidate
        if fits is not None:
            return fits
        first = batch[0]
        # A fused step's time grows with its chunk: bisect for the longest that fits.
        sizes = -(-first.num_remaining // CHUNK_GRANULE)
        low, high = 1, sizes
        while low <= high:
            middle = (low + high) // 2
            tokens = min(middle * CHUNK_GRANULE, first.num_remaining)
            chunk = tokens if tokens < first.num_remaining else None
            candidate = self._fused_step((first,), chunk, decode_ctx)
            if candidate.seconds <= limit_s:
                fits, low = candidate, middle + 1
            else:
                high = middle - 1
        return fits

    def _prefill_late_tpot_holds(self, stats: LatencyStats, risky: bool) -> bool:
        """Whether TTFT misses its SLO (a prompt of the batch at risk, or recent first tokens
        late) while recent TPOT holds: then prefill comes first, as in the split's rules, and a
        fused step may outlast the TPOT budget. A request's TPOT is the mean of the steps it
        rides in, and decode-only steps between fused ones are shorter than the SLO."""
        if stats.p90_tpot_s is None or stats.p90_tpot_s > self.slo.tpot_s:
            return False
        return risky or (stats.p90_ttft_over_slo is not None and stats.p90_ttft_over_slo > 1.0)

    def _fused_step(
        self, prompts: tuple[SeqView, ...], chunk: int | None, decode_ctx: tuple[int, ...]
    ) -> Fusion:
        """A fused step of `prompts` (the next `chunk` tokens of the one prompt, if set) and a
        token of every decoding request on every unit."""
        if chunk is None:
            pieces = [(s.num_remaining, s.num_computed_tokens) for s in prompts]
        else:
            pieces = [(chunk, prompts[0].num_computed_tokens)]
        lens = tuple(n for n, _ in pieces)
        cached = tuple(c for _, c in pieces)
        prefill_alone, decode_alone = self._alone_s(lens, cached, decode_ctx, self.num_layers)
        fused, _ = fused_step_state(pieces, list(decode_ctx), self.units.total)
        seconds = self.perf.predict(fused).prefill_s
        return Fusion(prompts, chunk, (prefill_alone + decode_alone) / seconds, seconds)

    def _alone_s(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
    ) -> tuple[float, float]:
        """(prefill step, decode step) each alone on every unit."""
        total = self.units.total
        prefill = self.perf.predict(
            ExecutionState(
                prefill_lens=prefill_lens,
                prefill_cached=_cached(cached),
                prefill_units=total,
                prefill_layers=layers,
            )
        ).prefill_s
        decode = self.perf.predict(
            ExecutionState(decode_ctx=decode_ctx, decode_units=total)
        ).decode_s
        return prefill, decode

    def _decode_can_pause(
        self,
        prefill_lens: tuple[int, ...],
        cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layers: int,
    ) -> bool:
        """Whether a full-device prefill step followed by a full-device decode step still fits
        in one TPOT: then decode may wait out the prefill step."""
        budget = self.slo.tpot_s * TPOT_HEADROOM
        return sum(self._alone_s(prefill_lens, cached, decode_ctx, layers)) <= budget

    def _round_down(self, units: int) -> int:
        valid = [c for c in self.units.counts() if c <= units]
        return valid[-1] if valid else 0

    # ---- the prefill batch ------------------------------------------------------------------

    def predicted_prefill_s(self, tokens: int) -> float:
        es = ExecutionState(prefill_lens=(tokens,), prefill_units=self.units.total)
        return self.perf.predict(es).prefill_s

    def at_risk(self, seq: SeqView, now: float) -> bool:
        budget = self.slo.ttft_s(seq.num_remaining)
        waited = now - seq.arrival_time
        return waited + self.predicted_prefill_s(seq.num_remaining) >= RISK_SHARE * budget

    def order_waiting(self, snap: BulletSnapshot) -> list[SeqView]:
        """At-risk requests first (earliest deadline first), then the rest by least predicted
        latency."""
        at_risk = [s for s in snap.waiting if self.at_risk(s, snap.now)]
        risky = {s.request_id for s in at_risk}
        rest = [s for s in snap.waiting if s.request_id not in risky]
        at_risk.sort(key=lambda s: s.arrival_time + self.slo.ttft_s(s.num_remaining))
        rest.sort(key=lambda s: (s.num_remaining, s.arrival_time))
        return at_risk + rest

    def _form_batch(self, snap: BulletSnapshot) -> tuple[SeqView, ...]:
        """Whole prompts in order while the batch is below the compute-saturation point and
        fits the token, sequence and KV budgets. No overtaking: the first that does not fit
        ends the batch, so an at-risk request is never passed over."""
        batch: list[SeqView] = []
        tokens = 0
        free = snap.free_blocks
        # Keep a block per decoding request free so the decode lane can grow without preempting.
        reserve = min(len(snap.decoding), free)
        seats = snap.max_num_seqs - len(snap.decoding)
        for seq in self.order_waiting(snap):
            need = -(-seq.num_tokens // snap.block_size) - seq.num_blocks
            if batch and (
                tokens >= self.saturation_tokens
                or tokens + seq.num_remaining > snap.max_prefill_tokens
            ):
                break
            if seats <= 0 or need > free - reserve:
                break
            batch.append(seq)
            tokens += seq.num_remaining
            free -= need
            seats -= 1
        return tuple(batch)

    def _saturation_tokens(self) -> int:
        """Tokens at which a prefill on the whole device stops getting cheaper per token: past
        it, a bigger batch only delays the first request's TTFT."""
        best = None
        for tokens in (2**k for k in range(4, 15)):
            per_token = self.predicted_prefill_s(tokens) / tokens
            if best is not None and per_token > 0.9 * best:
                return tokens // 2
            best = per_token if best is None else min(best, per_token)
        return 2**14


def _fused_rule(fusion: Fusion, within_budget: str) -> str:
    return "fused-ttft-first" if fusion.ttft_first else within_budget


def _cached(cached: tuple[int, ...]) -> tuple[int, ...]:
    """Prompts' tokens already in the KV cache as ExecutionState takes them (() for none)."""
    return cached if any(cached) else ()
