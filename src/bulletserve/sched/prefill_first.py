"""Prefill-first (vLLM v0, Orca): whole prompts first, then a decode-only step.

A step either prefills waiting prompts in full, or decodes every running request; never both.
"""

from __future__ import annotations

from dataclasses import dataclass

from bulletserve.sched.base import PlanBuilder, SchedulerSnapshot, StepPlan


@dataclass
class PrefillFirstPolicy:
    name: str = "prefill-first"

    def plan(self, snapshot: SchedulerSnapshot) -> StepPlan:
        if snapshot.waiting:
            prefill = PlanBuilder(snapshot, snapshot.max_num_batched_tokens)
            prefill.budget.seqs -= len(snapshot.running)
            # A prompt longer than the token budget still runs, alone.
            prefill.admit_waiting(chunk=False, allow_over_budget_first=True)
            if prefill.scheduled:
                return prefill.build()
        decode = PlanBuilder(snapshot, snapshot.max_num_batched_tokens + len(snapshot.running))
        decode.schedule_running(chunk=False)
        return decode.build()
