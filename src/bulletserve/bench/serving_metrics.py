"""Serving metrics from request records, with vLLM `benchmark_serving`'s definitions.

- TTFT: send to first streamed chunk with output. E2EL: send to last such chunk.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request; requests with one output token are
  left out of TPOT statistics (and count as TPOT 0 for goodput and attainment).
- ITL: every gap between consecutive output chunks, pooled over all requests.
- Throughputs divide totals over successful requests by the run's wall time.
- Statistics: mean, median, P90, P99 (numpy's linear-interpolated percentiles) and the population
  standard deviation, in milliseconds. An empty set gives null (vLLM prints 0).
- Goodput: successful requests per second whose TTFT, TPOT and E2EL all meet the given SLOs.
- SLO attainment (Bullet): the share of all sent requests (failed ones count as misses) whose
  normalized TTFT (TTFT / input tokens) and TPOT both meet their SLOs. In a mixed workload each
  request is held to its class's SLO: attainment and goodput (requests a second that met it)
  per class, and over all requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from bulletserve.bench.classes import WorkloadClass
from bulletserve.bench.records import RequestRecord
from bulletserve.sched.slo import SLO

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first; None for failed or one-token requests."""
    if not record.success or record.output_len <= 1:
        return None
    assert record.e2el_s is not None and record.ttft_s is not None
    return (record.e2el_s - record.ttft_s) / (record.output_len - 1)


def stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/median/p90/p99/std in milliseconds of values given in seconds."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {
        "mean": float(np.mean(ms)),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
        "std": float(np.std(ms)),
    }


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO | None = None,
    goodput_ms: dict[str, float] | None = None,
    classes: Sequence[WorkloadClass] = (),
) -> dict[str, Any]:
    """The run summary written to JSON and printed as the table. With `classes`, each record
    is scored against its class's SLO (`slo` is then not used)."""
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    tpots = [t for t in (tpot_s(r) for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itls_s]
    total_in = sum(r.input_len for r in done)
    total_out = sum(r.output_len for r in done)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter((r.error or "unknown error")[:200] for r in failed).most_common(5)),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft_ms": stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms(itls),
        "e2el_ms": stats_ms([r.e2el_s for r in done if r.e2el_s is not None]),
    }
    if goodput_ms:
        good = sum(1 for r in done if _meets_goodput(r, goodput_ms))
        summary["goodput_slo_ms"] = dict(goodput_ms)
        summary["request_goodput"] = good / duration_s
    if classes:
        summary["classes"] = {c.name: class_summary(records, c, duration_s) for c in classes}
        met = sum(score["met"] for score in summary["classes"].values())
        summary["slo"] = {
            "mixed": True,
            "met": met,
            "attainment": met / len(records) if records else None,
            "goodput": met / duration_s,
        }
    elif slo is not None:
        summary["slo"] = attainment(records, slo)
    return summary


def class_summary(
    records: Sequence[RequestRecord], workload_class: WorkloadClass, duration_s: float
) -> dict[str, Any]:
    """One class's attainment at its own SLO, its goodput, and its share and priority."""
    mine = [r for r in records if r.slo_class == workload_class.name]
    score = attainment(mine, workload_class.slo)
    return score | {
        "requests": len(mine),
        "goodput": score["met"] / duration_s,
        "priority": workload_class.priority,
    }


def _meets_goodput(record: RequestRecord, goodput_ms: dict[str, float]) -> bool:
    values_s = {"ttft": record.ttft_s, "tpot": tpot_s(record) or 0.0, "e2el": record.e2el_s}
    return all(values_s[name] * 1000.0 <= limit for name, limit in goodput_ms.items())


def normalized_ttft_ms(record: RequestRecord) -> float:
    """TTFT per input token, in milliseconds (successful requests only)."""
    assert record.ttft_s is not None
    return record.ttft_s * 1000.0 / max(record.input_len, 1)


def attainment(records: Sequence[RequestRecord], slo: SLO) -> dict[str, Any]:
    """Bullet's SLO attainment, with the P90 of normalized TTFT and of TPOT."""
    done = [r for r in records if r.success]
    norm_ttfts = [normalized_ttft_ms(r) for r in done]
    met = sum(
        1
        for r in done
        if r.ttft_s * 1000.0 <= slo.ttft_limit_ms(r.input_len)
        and (tpot_s(r) or 0.0) * 1000.0 <= slo.tpot_ms
    )
    multi_token = [t * 1000.0 for t in (tpot_s(r) for r in done) if t is not None]
    return {
        "ttft_per_token_ms": slo.ttft_per_token_ms,
        "ttft_base_ms": slo.ttft_base_ms,
        "tpot_ms": slo.tpot_ms,
        "met": met,
        "attainment": met / len(records) if records else None,
        "p90_norm_ttft_ms": float(np.percentile(norm_ttfts, 90)) if norm_ttfts else None,
        "p90_tpot_ms": float(np.percentile(multi_token, 90)) if multi_token else None,
    }
