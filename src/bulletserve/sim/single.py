"""One lane: `LLMEngine.step` on the virtual clock, for the chunked and prefill-first policies.

Each step: queue arrivals, snapshot, plan, apply preemptions, admit, grow blocks, run the batch
(its duration from the performance model on every unit), then count computed tokens and sample
the requests whose computed tokens reached their length. With nothing to run, the clock jumps to
the next arrival.
"""

from __future__ import annotations

from bulletserve.executor.record import StepRecord
from bulletserve.perf.state import fused_step_state
from bulletserve.sched.base import Policy, SchedulerSnapshot
from bulletserve.sim.device import CachedPerfModel, Noise
from bulletserve.sim.state import SimState


def run_single_lane(
    state: SimState,
    policy: Policy,
    perf: CachedPerfModel,
    noise: Noise,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> float:
    """Run every request to the end; returns the simulated time the last one finished."""
    units = perf.hw.units
    now = 0.0
    while True:
        state.drain(now)
        if not state.unfinished:
            return now
        snapshot = SchedulerSnapshot(
            now=now,
            waiting=tuple(r.view() for r in state.waiting),
            running=tuple(r.view() for r in state.running),
            free_blocks=state.allocator.num_free,
            block_size=state.block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        plan = policy.plan(snapshot)
        state.apply_preemptions(plan.preempted)
        if not plan.scheduled:
            arrival = state.next_arrival()
            if arrival is None:
                state.fail_unfinished("stalled: the policy schedules nothing and none arrive")
                return now
            now = max(now, arrival)
            continue
        admitted = set(plan.admitted)
        if admitted:
            moved = [r for r in state.waiting if r.request_id in admitted]
            for request in moved:
                state.waiting.remove(request)
            by_admission = {r.request_id: r for r in moved}
            state.running.extend(by_admission[i] for i in plan.admitted)
        by_id = {r.request_id: r for r in state.running}
        batch = [(by_id[item.request_id], item.num_tokens) for item in plan.scheduled]
        prefill: list[tuple[int, int]] = []
        decode_ctx: list[int] = []
        for request, num in batch:
            state.grow_blocks(request, request.num_computed_tokens + num)
            if request.token_times and request.num_computed_tokens == request.num_tokens - 1:
                decode_ctx.append(request.num_tokens)
            else:
                prefill.append((num, request.num_computed_tokens))
        es, phase = fused_step_state(prefill, decode_ctx, units)
        prediction = perf.predict(es)
        predicted = prediction.prefill_s if phase == "prefill" else prediction.decode_s
        measured = predicted * noise.factor()
        sampled = sum(r.num_computed_tokens + num == r.num_tokens for r, num in batch)
        # Tokens reach their stream after the engine's host work around the step.
        now += measured + perf.host_s(sampled)
        for request, num in batch:
            request.num_computed_tokens += num
            if request.num_computed_tokens == request.num_tokens:
                state.append_token(request, now)
        prefill_tokens = sum(n for n, _ in prefill)
        state.log_step(
            StepRecord(
                time=now,
                lane=("hybrid" if decode_ctx else "prefill") if prefill else "decode",
                split=(units if prefill else 0, units if decode_ctx else 0),
                units=units,
                batch_size=len(batch),
                prefill_tokens=prefill_tokens,
                decode_rows=len(decode_ctx),
                state=es,
                predicted_s=predicted,
                measured_s=measured,
            )
        )
