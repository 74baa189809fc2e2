"""What a policy sees (a snapshot) and what it decides (a plan). Pure data, no torch, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from bulletserve.sched.drafts import DraftRow, DraftRule
from bulletserve.sched.slo import SLO

# vLLM's --scheduling-policy: first come first served, or by each request's `priority` (lower
# first, then arrival).
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


# A policy reads its snapshot and never changes it. SeqView and ScheduledSeq are made for every
# running request at every step: plain slotted dataclasses, as a frozen one costs about three
# times as much to build (each field set through object.__setattr__).
@dataclass(slots=True)
class SeqView:
    """One request as the policy sees it."""

    request_id: str
    arrival_time: float
    num_tokens: int  # prompt + generated so far
    num_computed_tokens: int  # tokens whose KV is in the cache
    num_blocks: int  # KV blocks held
    # Of those, blocks another request holds too (a shared cached prefix): preempting this
    # request does not free them.
    num_shared_blocks: int = 0
    priority: int = 0  # lower runs first; 0 for every request under FCFS
    slo: SLO | None = None  # its own targets, or the server's (None: the server has none)
    # When its first token came (None: not yet) and how many it has generated: its TPOT so far.
    first_token_time: float | None = None
    num_output_tokens: int = 0
    # Tokens drafted for it to verify in its next decode row (speculative decoding), beyond
    # its own: the row may compute 1 + these (`PlanBuilder.add_drafts`), and the chance that
    # each holds given the one before did (`sched.drafts.acceptance_estimate`).
    num_draft_tokens: int = 0
    draft_acceptance: float = 0.0
    lora: str | None = None  # its LoRA adapter's identity (None: the base model)

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before the next sample (1 for a decoding request)."""
        return self.num_tokens - self.num_computed_tokens


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The engine's state at the start of a step."""

    now: float
    waiting: tuple[SeqView, ...]  # in queue order (preempted requests first)
    running: tuple[SeqView, ...]  # in admission order, oldest first
    free_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # The engine's own seconds around a step, outside the model (planning, drawing, handing
    # the outputs over), as measured lately: a step's price beside its forward.
    host_step_s: float = 0.0
    # The most LoRA adapters the running requests may use together (--max-loras; None: any).
    max_loras: int | None = None


@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    num_tokens: int  # tokens to compute this step


@dataclass(frozen=True)
class StepPlan:
    """One step: which requests compute how many tokens, and which running ones to preempt."""

    scheduled: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[str, ...] = ()
    admitted: tuple[str, ...] = field(default=())  # waiting requests that start running

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Policy(Protocol):
    name: str

    def plan(self, snapshot: SchedulerSnapshot) -> StepPlan: ...


def check_priority(priority: int, policy: SchedulingPolicy) -> None:
    """ValueError unless a request's `priority` can be honoured: any under priority scheduling,
    only 0 under FCFS (as vLLM refuses it)."""
    if priority and policy == "fcfs":
        raise ValueError(
            f"priority {priority}: this server schedules first come first served; start it "
            "with --scheduling-policy priority to order requests by priority"
        )


def keep_order(seq: SeqView) -> tuple[float, float]:
    """Which running requests keep their KV when blocks run out: the highest priority first,
    then the tightest TPOT target. Sorting is stable, so among equals admission order decides
    and the newest is preempted first."""
    return (seq.priority, seq.slo.tpot_ms if seq.slo else 0.0)


class AdapterBudget:
    """The LoRA adapters running requests use, at most `most` of them (None: any number)."""

    def __init__(self, most: int | None, running: tuple[SeqView, ...]) -> None:
        self.most = most
        # Without a bound nothing is counted (each step's plan would walk every running view).
        self.adapters = (
            set() if most is None else {seq.lora for seq in running if seq.lora is not None}
        )

    def admits(self, seq: SeqView) -> bool:
        """Whether `seq` may join them."""
        return (
            self.most is None
            or seq.lora is None
            or seq.lora in self.adapters
            or len(self.adapters) < self.most
        )

    def add(self, seq: SeqView) -> None:
        if self.most is not None and seq.lora is not None:
            self.adapters.add(seq.lora)


def blocks_needed(seq: SeqView, num_tokens: int, block_size: int) -> int:
    """Extra blocks `seq` needs to hold `num_tokens` more tokens."""
    total = seq.num_computed_tokens + num_tokens
    return max(0, -(-total // block_size) - seq.num_blocks)


@dataclass
class _Budget:
    tokens: int
    blocks: int
    seqs: int


class PlanBuilder:
    """Accumulates a plan while tracking the token, block and sequence budgets."""

    def __init__(self, snapshot: SchedulerSnapshot, token_budget: int) -> None:
        self.snapshot = snapshot
        self.budget = _Budget(token_budget, snapshot.free_blocks, snapshot.max_num_seqs)
        self.scheduled: list[ScheduledSeq] = []
        self.preempted: list[str] = []
        self.admitted: list[str] = []

    def schedule_running(self, chunk: bool) -> None:
        """Schedule running requests in `keep_order`; when blocks run out, preempt from the
        end of it (the newest, where priorities and SLOs are alike).

        With `chunk`, a request that is still prefilling gets as many tokens as the budget allows;
        without it, every running request is decoding and needs exactly one. Drafts come last
        (`add_drafts`).
        """
        running = sorted(self.snapshot.running, key=keep_order)
        self.budget.seqs -= len(running)
        while running:
            seq = running.pop(0)
            num = min(seq.num_remaining, self.budget.tokens) if chunk else seq.num_remaining
            if num <= 0:
                continue
            need = blocks_needed(seq, num, self.snapshot.block_size)
            while need > self.budget.blocks and running:
                victim = running.pop()
                self._preempt(victim)
            if need > self.budget.blocks:
                self._preempt(seq)
                continue
            self._take(seq, num, need)

    def admit_waiting(self, chunk: bool, allow_over_budget_first: bool = False) -> None:
        """Admit waiting requests in queue order while budgets last (and their LoRA adapters
        within `max_loras` together with the running ones'); stop at the first that does not
        fit (no overtaking, so the queue head cannot starve)."""
        adapters = AdapterBudget(self.snapshot.max_loras, self.snapshot.running)
        for seq in self.snapshot.waiting:
            if self.budget.seqs <= 0 or self.preempted or not adapters.admits(seq):
                return
            num = seq.num_remaining
            if num > self.budget.tokens:
                first = not self.scheduled and allow_over_budget_first
                if chunk and self.budget.tokens > 0:
                    num = self.budget.tokens
                elif not first:
                    return
            need = blocks_needed(seq, num, self.snapshot.block_size)
            if need > self.budget.blocks:
                return
            self.budget.seqs -= 1
            self.admitted.append(seq.request_id)
            adapters.add(seq)
            self._take(seq, num, need)

    def add_drafts(self, rule: DraftRule | None) -> None:
        """Let the scheduled decode rows verify drafts, from the token budget the step's needed
        work left: as many as `rule` finds worth their cost (None: all of them, while the budget
        lasts), each row's in `keep_order` while blocks last."""
        snapshot = self.snapshot
        if self.budget.tokens <= 0 or not any(seq.num_draft_tokens for seq in snapshot.running):
            return
        # The admitted requests are the queue's head (admission never overtakes).
        admitted = snapshot.waiting[: len(self.admitted)]
        views = {seq.request_id: seq for seq in (*snapshot.running, *admitted)}
        contexts: list[int] = []  # the decode rows', each with its own token
        offered: dict[int, DraftRow] = {}
        rows: list[tuple[int, SeqView]] = []  # (index in the plan, view) of each decode row
        for index, scheduled in enumerate(self.scheduled):
            seq = views[scheduled.request_id]
            if seq.num_remaining != 1 or not seq.num_output_tokens:
                continue  # a prompt chunk
            if seq.num_draft_tokens:
                offered[len(rows)] = DraftRow(seq.num_draft_tokens, seq.draft_acceptance)
            contexts.append(seq.num_computed_tokens + 1)
            rows.append((index, seq))
        if not offered:
            return
        if rule is not None:
            counts = rule.choose(contexts, offered, self.budget.tokens, snapshot.host_step_s)
        else:
            counts = {row: offer.drafts for row, offer in offered.items()}
        for row, count in sorted(counts.items()):
            index, seq = rows[row]
            count = min(count, self.budget.tokens)
            size = snapshot.block_size
            need = blocks_needed(seq, 1 + count, size) - blocks_needed(seq, 1, size)
            while count and need > self.budget.blocks:
                count -= 1
                need = blocks_needed(seq, 1 + count, size) - blocks_needed(seq, 1, size)
            if count:
                self.scheduled[index].num_tokens += count
                self.budget.tokens -= count
                self.budget.blocks -= need

    def build(self) -> StepPlan:
        return StepPlan(tuple(self.scheduled), tuple(self.preempted), tuple(self.admitted))

    def _take(self, seq: SeqView, num: int, blocks: int) -> None:
        self.scheduled.append(ScheduledSeq(seq.request_id, num))
        self.budget.tokens -= num
        self.budget.blocks -= blocks

    def _preempt(self, seq: SeqView) -> None:
        self.preempted.append(seq.request_id)
        self.budget.blocks += seq.num_blocks - seq.num_shared_blocks
        self.budget.seqs += 1
