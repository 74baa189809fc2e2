"""The two lanes' state machine, as the laned engine (`engine.lanes`) and the laned simulator
(`sim.laned`) both run it: the prefill batch in flight and its passes, the step each lane runs
and the units it holds, whether a step may start, the snapshot a lane plans from, what ran
while a step ran, and how long an idle lane waits before it plans again.

A lane's turn: unless it `may_plan` (it has work, and the other lane's step leaves it units)
it waits; else `plan(lane, now)` (the plan's split
comes into force); unless the plan is `runnable` now, the lane waits `wait_s(lane)` or until
woken; else `start_prefill` / `start_decode` claim the lane's units and record the step in
flight, the executor runs it (threads and the device in the engine; the modeled device's time
in the simulator), and `end_step` (after `release_units`, where the executor's bookkeeping comes
later than the device's end) ends it, after which a prefill step's executor calls `end_pass`
when the step finished a pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic

from bulletserve.bookkeeping.book import E, RequestBook
from bulletserve.bookkeeping.record import Lane, StepRecord
from bulletserve.perf.execution_state import ExecutionState, fused_step_state
from bulletserve.perf.model import Corrections
from bulletserve.sched.bullet import (
    BulletPlan,
    BulletPolicy,
    BulletSnapshot,
    PrefillInFlight,
    PrefillStep,
    Split,
)

LANES: tuple[Lane, ...] = ("prefill", "decode")
# An idle lane with work of its own plans again this often: its plan may change with time alone
# (a prompt comes at risk) or with the other lane's plans (the split in force).
POLL_S = 0.005
# With nothing to do, or while the other lane's step holds every unit (its end wakes this lane),
# a lane plans again at the latest after this long.
IDLE_S = 0.5


def other_lane(lane: Lane) -> Lane:
    return "decode" if lane == "prefill" else "prefill"


@dataclass(frozen=True)
class Placement:
    """Where a lane's step runs: on `units` units (threads, SMs), or on the units beside a
    group of that many (`rest`); None: on every unit (one lane). The split as the one value
    every tensor-parallel rank applies (rank 0's runner announces it with the step)."""

    units: int | None = None
    rest: bool = False

    def count(self, total: int) -> int:
        """How many units the step runs on."""
        if self.units is None:
            return total
        return total - self.units if self.rest else self.units


EVERY_UNIT = Placement()


@dataclass
class PrefillBatch(Generic[E]):
    """The prefill lane's batch: prompts (plus tokens to recompute after preemption) that it
    computes in passes over the layers, a pass taking every prompt's rest or a chunk of the
    batch's one prompt; the prompts join the decode lane after the pass that completes them.
    Per pass: each prompt's tokens in it and in the cache before it, and the decoding requests
    whose next token rides in its step (the fused rules)."""

    requests: list[E]
    layers_done: int = 0
    pass_tokens: tuple[int, ...] = ()
    pass_cached: tuple[int, ...] = ()
    fused: list[E] = field(default_factory=list)


@dataclass
class LaneStep(Generic[E]):
    """A step in flight: the split it started under and the units it holds; a decode step's
    rows and their contexts, or a prefill step's layers and its pass (with any fused rows);
    `state` is what ran on the device when it started, as the performance model takes it."""

    lane: Lane
    split: Split
    placement: Placement
    units: int  # how many units `placement` gives it
    requests: list[E]
    holds: bool = field(default=True, init=False)  # whether it still holds its units
    layers: tuple[int, int] = (0, 0)
    lengths: tuple[int, ...] = ()  # decode: contexts; prefill: the pass's tokens per prompt
    cached: tuple[int, ...] = ()  # prefill: the pass's tokens in the cache before it
    fused: list[E] = field(default_factory=list)
    fused_ctx: tuple[int, ...] = ()
    drafts: tuple[int, ...] = ()  # decode: each row's drafts to verify (empty: none anywhere)
    state: ExecutionState = field(default_factory=ExecutionState)

    @property
    def row_drafts(self) -> tuple[int, ...]:
        """A decode step's drafts per row, 0 where a row has none."""
        return self.drafts or (0,) * len(self.requests)

    def record(
        self,
        time: float,
        measured_s: float,
        predicted_s: float | None,
        runner_s: float | None = None,
        accepted_tokens: int | None = None,
        propose_s: float | None = None,
    ) -> StepRecord:
        """The step as the step log records it, under the split it started under;
        `accepted_tokens`: under speculative decoding, of a decode step's drafts those
        accepted, `propose_s` the proposer's seconds for them."""
        prefill = self.lane == "prefill"
        return StepRecord(
            time=time,
            lane=self.lane,
            split=(self.split.prefill, self.split.decode),
            rule=self.split.rule,
            units=self.units,
            batch_size=len(self.requests),
            prefill_tokens=sum(self.lengths) if prefill else 0,
            decode_rows=len(self.fused) if prefill else len(self.requests),
            layers=self.layers if prefill else None,
            state=self.state,
            predicted_s=predicted_s,
            measured_s=measured_s,
            runner_s=runner_s,
            draft_tokens=None if accepted_tokens is None else sum(self.drafts),
            accepted_tokens=accepted_tokens,
            propose_s=propose_s,
        )


@dataclass
class PassEnd(Generic[E]):
    """What a pass's end leaves to sample: the prompts it completed (`joined`, in the batch's
    order: they join the decode lane) and the fused rows, none of them aborted; `rows` are
    their positions in the step's batch (prompts first, then the fused rows)."""

    joined: list[E]
    fused: list[E]
    rows: list[int]

    @property
    def sampled(self) -> list[E]:
        return self.joined + self.fused


class LaneCore(Generic[E]):
    """The state both laned executors share. Not thread-safe: the engine holds its lock."""

    def __init__(
        self,
        book: RequestBook[E],
        policy: BulletPolicy,
        max_num_seqs: int,
        max_prefill_tokens: int,
        max_loras: int | None = None,
    ) -> None:
        self.book = book
        self.max_loras = max_loras
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.total = policy.units.total
        self.num_layers = policy.num_layers
        self.split = Split(0, self.total, "no-prefill")
        self.window = policy.latency_window()
        self.prefill: PrefillBatch[E] | None = None
        self.steps: dict[Lane, LaneStep[E] | None] = dict.fromkeys(LANES)

    # ---- planning ---------------------------------------------------------------------------

    def snapshot(self, now: float, corrections: Corrections = Corrections()) -> BulletSnapshot:
        prefill = None
        if self.prefill is not None:
            views = tuple(r.view() for r in self.prefill.requests)
            stepping = self.steps["prefill"] is not None
            prefill = PrefillInFlight(views, self.prefill.layers_done, stepping)
        return BulletSnapshot(
            now=now,
            waiting=self.book.waiting_views(),
            prefill=prefill,
            # Every decoding request, those in the decode lane's running step too: the prefill
            # lane must see that decode has work, or its split would claim the decode lane's
            # units and wait for them while decode keeps stepping.
            decoding=self.book.running_views(),
            free_blocks=self.book.allocator.num_free,
            block_size=self.book.block_size,
            max_num_seqs=self.max_num_seqs,
            max_prefill_tokens=self.max_prefill_tokens,
            stats=self.window.stats(),
            split=self.split,
            corrections=corrections,
            max_loras=self.max_loras,
        )

    def plan(self, lane: Lane, now: float, corrections: Corrections = Corrections()) -> BulletPlan:
        """The lane's plan; its split comes into force."""
        snap = self.snapshot(now, corrections)
        if lane == "prefill":
            plan = self.policy.plan_prefill(snap)
        else:
            plan = self.policy.plan_decode(snap)
        self.split = plan.split
        return plan

    def decode_paused(self) -> bool:
        """While a prefill step carries the decode rows, the decode lane does not plan (a
        preemption would take a request out from under that step)."""
        return self.prefill is not None and bool(self.prefill.fused)

    def placement(self, lane: Lane, split: Split) -> Placement:
        """Where a lane's step runs under `split`: prefill on its group of units, decode on
        the units beside that group (on a GPU, the disjoint remainder); with no prefill units
        (or no partitioning) a lane has every unit."""
        if self.policy.partition == "none" or split.prefill == 0:
            return Placement(self.total)
        return Placement(split.prefill, rest=lane == "decode")

    def share(self, lane: Lane, split: Split) -> int:
        """How many units a lane's step runs on under `split`."""
        return self.placement(lane, split).count(self.total)

    def may_start(self, lane: Lane, split: Split) -> bool:
        """Whether the lane's step fits beside the other lane's running step. A step keeps its
        units until it ends: a lane that the new split gives more waits for them rather than
        oversubscribing the device (on a CPU two thread teams on one core stall each other at
        every barrier). Without partitioning, both lanes share every unit by design."""
        other = self.steps[other_lane(lane)]
        if self.policy.partition == "none" or other is None or not other.holds:
            return True
        return self.share(lane, split) + other.units <= self.total

    def runnable(self, lane: Lane, plan: BulletPlan) -> bool:
        """Whether the plan gives the lane a step it can start now. A fused step also waits
        for a decode step to be wholly over: its rows are the decode lane's requests."""
        if lane == "prefill":
            step = plan.prefill
            if step is None or (step.decode and self.steps["decode"] is not None):
                return False
            units = plan.split.prefill
        else:
            if not plan.decode:
                return False
            units = plan.split.decode
        return units > 0 and self.may_start(lane, plan.split)

    def has_work(self, lane: Lane, pending: bool = False) -> bool:
        """Whether the lane has anything to plan: a prompt to prefill (or, with `pending`,
        requests or aborts the executor has yet to take in) for the prefill lane, sequences to
        decode for the decode lane."""
        if lane == "prefill":
            return pending or bool(self.book.waiting) or self.prefill is not None
        return bool(self.book.running)

    def blocked(self, lane: Lane) -> bool:
        """Whether the other lane's running step holds every unit: nothing the lane could plan
        can start before that step ends (whose end wakes it)."""
        other = self.steps[other_lane(lane)]
        return (
            self.policy.partition != "none"
            and other is not None
            and other.holds
            and other.units >= self.total
        )

    def may_plan(self, lane: Lane, pending: bool = False) -> bool:
        """Whether the lane plans now: it has work (`has_work`), the decode lane is not paused
        under a fused step, and the other lane's step leaves it units. A lane that planned
        while it could not start would take the GIL and a core from the compute threads (woken
        by every arrival, and on two cores the step's whole thread team waits for the one it
        preempts at every barrier)."""
        if lane == "decode" and self.decode_paused():
            return False
        return self.has_work(lane, pending) and not self.blocked(lane)

    def wait_s(self, lane: Lane, pending: bool = False) -> float:
        """How long an idle lane waits (unless woken: a request arrives or leaves, a step ends)
        before it plans again. Quickly while it has work of its own and the other lane's step
        leaves it units to start on; while that step holds every unit nothing can start before
        it ends, and a lane planning every few ms meanwhile would take the GIL and a core from
        the compute threads (0.5 ms of Python every 5 ms on another thread slowed a 2-thread
        decode step 7-9%)."""
        return POLL_S if self.has_work(lane, pending) and not self.blocked(lane) else IDLE_S

    # ---- steps ------------------------------------------------------------------------------

    def start_prefill(self, plan: BulletPlan) -> LaneStep[E]:
        """Claim the prefill lane's units for the plan's step: a new batch's admission, a new
        pass (every prompt's rest, or the step's chunk of the one prompt, and the fused rows),
        and the step in flight. Every request the step computes is busy until its pass ends."""
        step = plan.prefill
        assert step is not None
        if step.admitted:
            self._admit(step.admitted)
        batch = self.prefill
        assert batch is not None
        if step.layer_start == 0:
            self._begin_pass(batch, step)
        return self._start(
            LaneStep(
                "prefill",
                plan.split,
                placement := self.placement("prefill", plan.split),
                placement.count(self.total),
                batch.requests,
                (step.layer_start, step.layer_end),
                batch.pass_tokens,
                batch.pass_cached,
                batch.fused,
                tuple(r.num_tokens for r in batch.fused),
            )
        )

    def start_decode(self, plan: BulletPlan) -> LaneStep[E]:
        """Claim the decode lane's units for the plan's rows (after its preemptions), with KV
        for their next tokens and the drafts each verifies; the rows are busy until the step
        ends."""
        by_id = {r.request_id: r for r in self.book.running}
        requests = [by_id[s.request_id] for s in plan.decode]
        drafts = tuple(
            min(s.num_tokens - 1, r.num_draft_tokens)
            for s, r in zip(plan.decode, requests, strict=True)
        )
        for request, count in zip(requests, drafts, strict=True):
            self.book.grow_blocks(request, request.num_tokens + count)
        self.book.busy.update(r.request_id for r in requests)
        lengths = tuple(r.num_tokens for r in requests)
        placement = self.placement("decode", plan.split)
        units = placement.count(self.total)
        step = LaneStep("decode", plan.split, placement, units, requests, lengths=lengths)
        step.drafts = drafts if any(drafts) else ()
        return self._start(step)

    def release_units(self, lane: Lane) -> None:
        """The lane's step is done on the device: the other lane may start on its units while
        this one does the step's bookkeeping (`end_step`)."""
        step = self.steps[lane]
        assert step is not None
        step.holds = False

    def end_step(self, lane: Lane, rejected: Callable[[E], int] = lambda _: 0) -> LaneStep[E]:
        """Release the lane's units; a decode step's rows have computed their token and the
        drafts the model accepted (`rejected`: of a row's drafts, those it did not: not
        counted, their blocks freed) and are no longer busy."""
        step = self.steps[lane]
        assert step is not None
        self.steps[lane] = None
        if lane == "decode":
            rows = zip(step.requests, step.lengths, step.row_drafts, strict=True)
            for request, length, count in rows:
                dropped = rejected(request) if count else 0
                request.num_computed_tokens = length + count - dropped
                if dropped:
                    self.book.trim_blocks(request, request.num_computed_tokens + 1)
                self.book.cache_computed(request)
            self.book.busy.difference_update(r.request_id for r in step.requests)
        else:
            assert self.prefill is not None
            self.prefill.layers_done = step.layers[1]
        return step

    def end_pass(self, is_finished: Callable[[E], bool]) -> PassEnd[E]:
        """After a pass's last layer: count its tokens; the fused rows and, once every prompt is
        complete, the prompts leave the lane (the prompts join the decode lane); a prompt with
        chunks to go stays. A request aborted while the step ran (`is_finished`) is dropped and
        its blocks freed; the batch leaves the lane too when every prompt was."""
        batch = self.prefill
        assert batch is not None
        prompts, fused = batch.requests, batch.fused
        for request, cached, tokens in zip(
            prompts, batch.pass_cached, batch.pass_tokens, strict=True
        ):
            request.num_computed_tokens = cached + tokens
        for request in fused:
            request.num_computed_tokens = request.num_tokens
        for request in prompts + fused:
            self.book.cache_computed(request)
        complete = all(r.num_computed_tokens == r.num_tokens for r in prompts)
        ends = complete or all(is_finished(r) for r in prompts)
        members = prompts + fused  # in the order of the step's batch
        self.book.busy.difference_update(r.request_id for r in (members if ends else fused))
        if ends:
            self.prefill = None
        else:
            batch.layers_done, batch.fused = 0, []
        result: PassEnd[E] = PassEnd([], [], [])
        for row, request in enumerate(members):
            if row < len(prompts) and not ends:
                continue
            if is_finished(request):
                self.book.release_blocks(request)
                continue
            (result.joined if row < len(prompts) else result.fused).append(request)
            result.rows.append(row)
        self.book.running.extend(result.joined)
        return result

    def execution_state(self) -> ExecutionState:
        """What runs on the device now, as the performance model takes it: both lanes' steps in
        flight, or a fused step's one batch of prompts and decode rows."""
        prefill, decode = self.steps["prefill"], self.steps["decode"]
        if prefill is not None and prefill.fused:
            prompts = list(zip(prefill.lengths, prefill.cached, strict=True))
            return fused_step_state(prompts, list(prefill.fused_ctx), prefill.units)[0]
        start, end = prefill.layers if prefill else (0, self.num_layers)
        return ExecutionState(
            prefill_lens=prefill.lengths if prefill else (),
            prefill_cached=prefill.cached if prefill and any(prefill.cached) else (),
            prefill_units=prefill.units if prefill else 0,
            decode_ctx=decode.lengths if decode else (),
            decode_units=decode.units if decode else 0,
            decode_drafts=decode.drafts if decode else (),
            prefill_layers=end - start,
            prefill_first_layer=start,
        )

    def _start(self, step: LaneStep[E]) -> LaneStep[E]:
        self.steps[step.lane] = step
        step.state = self.execution_state()
        return step

    def _admit(self, admitted: tuple[str, ...]) -> None:
        """A new batch of the admitted prompts, with KV for all their tokens. The whole batch
        is busy until its prefill ends: an abort between layer groups or chunks must not free
        blocks a later step writes."""
        requests = self.book.take_waiting(admitted)
        for request in requests:
            self.book.grow_blocks(request, request.num_tokens)
        self.book.busy.update(r.request_id for r in requests)
        self.prefill = PrefillBatch(requests)

    def _begin_pass(self, batch: PrefillBatch[E], step: PrefillStep) -> None:
        batch.pass_cached = tuple(r.num_computed_tokens for r in batch.requests)
        if step.chunk is None:
            batch.pass_tokens = tuple(r.num_tokens - r.num_computed_tokens for r in batch.requests)
        else:
            batch.pass_tokens = (step.chunk,)
        by_id = {r.request_id: r for r in self.book.running}
        batch.fused = [by_id[s.request_id] for s in step.decode]
        for request in batch.fused:
            self.book.grow_blocks(request, request.num_tokens)
        self.book.busy.update(r.request_id for r in batch.fused)
