"""Simulated requests as the bench's records, and a run as the bench's RunResult."""

from __future__ import annotations

from collections.abc import Sequence

from bulletserve.bench.classes import WorkloadClass
from bulletserve.bench.records import RequestRecord, RunResult
from bulletserve.bench.serving_metrics import summarize
from bulletserve.sched.slo import SLO
from bulletserve.sim.request import SimRequest


def to_record(request: SimRequest) -> RequestRecord:
    """What the bench client would have recorded: one streamed chunk per token, sent on
    arrival (times are offsets from the arrival)."""
    times = [t - request.arrival for t in request.token_times]
    success = request.error is None and request.finished_at is not None
    return RequestRecord(
        index=request.index,
        input_len=request.input_len,
        max_tokens=request.output_len,
        arrival_s=request.arrival,
        start_s=request.arrival,
        output_len=len(times),
        ttft_s=times[0] if success and times else None,
        e2el_s=times[-1] if success and times else None,
        token_times_s=times if success else [],
        success=success,
        error=request.error,
        slo_class=request.slo_class,
    )


def run_result(
    requests: Sequence[SimRequest],
    rate: float,
    burstiness: float,
    duration_s: float,
    slo: SLO | None,
    classes: Sequence[WorkloadClass] = (),
) -> RunResult:
    records = [to_record(r) for r in sorted(requests, key=lambda r: r.index)]
    return RunResult(
        request_rate=rate,
        burstiness=burstiness,
        max_concurrency=None,
        duration_s=duration_s,
        summary=summarize(records, duration_s, slo, classes=classes),
        requests=records,
    )
