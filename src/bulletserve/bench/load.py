"""One load level: send the workload on its arrival schedule, collect the records, summarize."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from bulletserve.bench.classes import WorkloadClass
from bulletserve.bench.datasets import WorkloadRequest
from bulletserve.bench.http_client import Target, send_request, spec_decode_counters
from bulletserve.bench.records import RequestRecord, RunResult
from bulletserve.bench.serving_metrics import summarize
from bulletserve.sched.slo import SLO
from bulletserve.spec.counters import SpecCounters


@dataclass(frozen=True)
class LoadLevel:
    """How hard to push: the mean rate (inf: all at once), burstiness and a concurrency cap."""

    request_rate: float
    burstiness: float = 1.0
    max_concurrency: int | None = None


async def run_level(
    client: httpx.AsyncClient,
    target: Target,
    workload: Sequence[WorkloadRequest],
    arrivals: Sequence[float],
    level: LoadLevel,
    count_tokens: Callable[[str], int],
    slo: SLO | None = None,
    goodput_ms: dict[str, float] | None = None,
    progress: bool = True,
    classes: Sequence[WorkloadClass] = (),
) -> RunResult:
    """Send every request at its arrival time (seconds from now) and wait for all of them.
    `classes`: a mixed workload's class of each request (empty: one SLO for all)."""
    semaphore = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
    bar = tqdm(total=len(workload), desc=f"rate {level.request_rate:g}", disable=not progress)
    records = [
        RequestRecord(index=i, input_len=w.input_len, max_tokens=w.output_len, arrival_s=t)
        for i, (w, t) in enumerate(zip(workload, arrivals, strict=True))
    ]
    class_of = list(classes) or [None] * len(records)
    for record, workload_class in zip(records, class_of, strict=True):
        record.slo_class = workload_class.name if workload_class else None
    counted = await spec_decode_counters(client, target)
    origin = time.perf_counter()

    async def one(
        request: WorkloadRequest, record: RequestRecord, workload_class: WorkloadClass | None
    ) -> None:
        delay = origin + record.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with semaphore or contextlib.nullcontext():
            await send_request(
                client, target, request.prompt, record, count_tokens, origin, workload_class
            )
        bar.update(1)

    try:
        await asyncio.gather(
            *(one(w, r, c) for w, r, c in zip(workload, records, class_of, strict=True))
        )
    finally:
        bar.close()
    duration = time.perf_counter() - origin
    summary = summarize(records, duration, slo, goodput_ms, _distinct(classes))
    after = await spec_decode_counters(client, target)
    if counted is not None and after is not None:
        summary["spec_decode"] = spec_decode_summary(counted, after)
    return RunResult(
        request_rate=level.request_rate,
        burstiness=level.burstiness,
        max_concurrency=level.max_concurrency,
        duration_s=duration,
        summary=summary,
        requests=records,
    )


def spec_decode_summary(before: SpecCounters, after: SpecCounters) -> dict[str, float | None]:
    """A run's speculative decoding from the server's counters before and after it (the
    server's other traffic in that time included): drafts, drafted and accepted tokens, the
    acceptance rate and the mean acceptance length (tokens a verified row made)."""
    run = after - before
    return {
        "num_drafts": run.num_drafts,
        "num_draft_tokens": run.num_draft_tokens,
        "num_accepted_tokens": run.num_accepted_tokens,
        "acceptance_rate": run.acceptance_rate,
        "mean_acceptance_length": run.mean_acceptance_length,
    }


def _distinct(classes: Sequence[WorkloadClass]) -> list[WorkloadClass]:
    """The classes of a run, each once, in the order they first come."""
    return list(dict.fromkeys(classes))
