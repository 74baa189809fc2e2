"""One single-lane step's bookkeeping, as the engine (`SingleLane.step`) and the simulator
(`sim.one_lane`) both carry a policy's `StepPlan` out: preemptions, admissions, KV blocks, which
rows are prompt chunks and which decode rows, and after the step the computed tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic

from bulletserve.bookkeeping.book import E, RequestBook
from bulletserve.bookkeeping.record import StepLane, StepRecord
from bulletserve.perf.execution_state import ExecutionState, fused_step_state
from bulletserve.sched.base import SchedulerSnapshot, StepPlan


def scheduler_snapshot(
    book: RequestBook,
    now: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    host_step_s: float = 0.0,
    max_loras: int | None = None,
) -> SchedulerSnapshot:
    return SchedulerSnapshot(
        host_step_s=host_step_s,
        max_loras=max_loras,
        now=now,
        waiting=book.waiting_views(),
        running=book.running_views(),
        free_blocks=book.allocator.num_free,
        block_size=book.block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


@dataclass
class SingleStep(Generic[E]):
    """The requests a step computes and how many tokens each, in the plan's order (none: the
    plan scheduled nothing); the prompt chunks as (new tokens, tokens cached before them) and
    the decode rows' contexts after the step, as `perf.execution_state.fused_step_state` takes
    them; and the requests the plan preempted."""

    batch: list[tuple[E, int]]
    preempted: list[E] = field(default_factory=list)
    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode_ctx: list[int] = field(default_factory=list)
    decode_drafts: list[int] = field(default_factory=list)  # each decode row's drafts to verify

    @property
    def draft_tokens(self) -> int:
        """Drafts its decode rows verify (speculative decoding)."""
        return sum(self.decode_drafts)

    @property
    def lane(self) -> StepLane:
        if not self.prefill:
            return "decode"
        return "hybrid" if self.decode_ctx else "prefill"

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill)

    def execution_state(self, units: int) -> tuple[ExecutionState, str]:
        """The step on every unit as the performance model takes it, and the phase whose time
        it takes (`perf.execution_state.fused_step_state`)."""
        return fused_step_state(self.prefill, self.decode_ctx, units, self.decode_drafts)

    def record(
        self,
        time: float,
        units: int,
        state: ExecutionState,
        measured_s: float,
        predicted_s: float | None = None,
        accepted_tokens: int | None = None,
        propose_s: float | None = None,
    ) -> StepRecord:
        """The step as the step log records it: every unit to the phases it ran; `state` is
        its `execution_state(units)`; `accepted_tokens`: of its drafts, those accepted (None:
        it does not speculate), `propose_s` the proposer's seconds for them."""
        return StepRecord(
            time=time,
            lane=self.lane,
            split=(units if self.prefill else 0, units if self.decode_ctx else 0),
            units=units,
            batch_size=len(self.batch),
            prefill_tokens=self.prefill_tokens,
            decode_rows=len(self.decode_ctx),
            state=state,
            measured_s=measured_s,
            predicted_s=predicted_s,
            draft_tokens=None if accepted_tokens is None else self.draft_tokens,
            accepted_tokens=accepted_tokens,
            propose_s=propose_s,
        )

    def sampled(self) -> list[E]:
        """After `end_single_step`: the requests whose next token is to be sampled, in the
        step's order."""
        return [r for r, _ in self.batch if r.num_computed_tokens == r.num_tokens]


def begin_single_step(book: RequestBook[E], plan: StepPlan) -> SingleStep[E]:
    """Apply the plan's preemptions and admissions and give every scheduled request blocks for
    its tokens."""
    preempted = book.preempt(plan.preempted)
    book.admit(plan.admitted)
    by_id = {r.request_id: r for r in book.running}
    batch = [(by_id[s.request_id], s.num_tokens) for s in plan.scheduled]
    step: SingleStep[E] = SingleStep(batch, preempted)
    for index, (request, num) in enumerate(step.batch):
        # An admitted prompt may find more of itself cached than its view said (a preemption
        # just now released blocks of the same prefix): it computes only what is left (a
        # decode row: its token and at most its drafts).
        left = request.num_tokens - request.num_computed_tokens
        num = min(num, left + request.num_draft_tokens if left == 1 else left)
        step.batch[index] = (request, num)
        book.grow_blocks(request, request.num_computed_tokens + num)
        # A decode row feeds back its last sampled token; anything else is a prompt chunk (a
        # recomputation after preemption included).
        if request.num_output_tokens and request.num_computed_tokens == request.num_tokens - 1:
            step.decode_ctx.append(request.num_tokens)
            step.decode_drafts.append(num - 1)
        else:
            step.prefill.append((num, request.num_computed_tokens))
    return step


def end_single_step(
    book: RequestBook[E],
    step: SingleStep[E],
    is_finished: Callable[[E], bool] = lambda _: False,
    rejected: Callable[[E], int] = lambda _: 0,
) -> None:
    """Count the tokens the step computed and cache the blocks they filled; a request that
    ended while the step ran (`is_finished`: under the engine's --async-scheduling, or in the
    middle of a verified row) is left alone, its blocks already freed. `rejected`: of a
    decode row's drafts, those the model did not accept: not counted, their blocks freed."""
    for request, num in step.batch:
        if is_finished(request):
            continue
        dropped = rejected(request)
        request.num_computed_tokens += num - dropped
        if dropped:
            book.trim_blocks(request, request.num_tokens)
        book.cache_computed(request)
