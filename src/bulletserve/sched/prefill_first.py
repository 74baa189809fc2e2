"""Prefill-first (vLLM v0, Orca): whole prompts first, then a decode-only step.

A step either prefills waiting prompts in full, or decodes every running request (with the
drafts `sched.drafts` lets them verify, under speculative decoding); never both.
"""

from __future__ import annotations

from dataclasses import dataclass

from bulletserve.sched.base import PlanBuilder, SchedulerSnapshot, StepPlan
from bulletserve.sched.drafts import DraftRule


@dataclass
class PrefillFirstPolicy:
    drafts: DraftRule | None = None  # None: every draft the budget leaves room for
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
        decode.add_drafts(self.drafts)
        return decode.build()
