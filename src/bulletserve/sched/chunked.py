"""Chunked prefill (Sarathi-Serve; vLLM v1 and SGLang's default): hybrid batches.

Every step runs all running decodes plus prefill chunks, up to `chunk_size` tokens in all.
"""

from __future__ import annotations

from dataclasses import dataclass

from bulletserve.sched.base import PlanBuilder, SchedulerSnapshot, StepPlan


@dataclass
class ChunkedPolicy:
    chunk_size: int
    name: str = "chunked"

    def plan(self, snapshot: SchedulerSnapshot) -> StepPlan:
        builder = PlanBuilder(snapshot, min(self.chunk_size, snapshot.max_num_batched_tokens))
        builder.schedule_running(chunk=True)
        builder.admit_waiting(chunk=True)
        return builder.build()
