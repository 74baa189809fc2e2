"""Chunked prefill (Sarathi-Serve; vLLM v1 and SGLang's default): hybrid batches.

Every step runs all running decodes plus prefill chunks, up to `chunk_size` tokens in all;
under speculative decoding the decode rows' drafts take what budget the step leaves
(`sched.drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bulletserve.sched.base import PlanBuilder, SchedulerSnapshot, StepPlan
from bulletserve.sched.drafts import DraftRule


@dataclass
class ChunkedPolicy:
    chunk_size: int
    drafts: DraftRule | None = None  # None: every draft the budget leaves room for
    name: str = "chunked"

    def plan(self, snapshot: SchedulerSnapshot) -> StepPlan:
        builder = PlanBuilder(snapshot, min(self.chunk_size, snapshot.max_num_batched_tokens))
        builder.schedule_running(chunk=True)
        builder.admit_waiting(chunk=True)
        builder.add_drafts(self.drafts)
        return builder.build()
