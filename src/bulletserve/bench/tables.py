"""Tables from `bullet bench` result files: a sweep's table (attainment, goodput, throughput and
latency per configuration and rate, and each configuration's highest rate at 90%), which SLO
each request missed, and the merge of several sweeps' files into one result per configuration.
`bullet bench table|misses|merge` prints and writes them."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from pathlib import Path

from bulletserve.bench.records import BenchResult, RunResult, load_result
from bulletserve.bench.serving_metrics import attainment, tpot_s
from bulletserve.sched.slo import SLO


def parse_slo(text: str) -> SLO:
    """TTFT_BASE_MS,TTFT_PER_TOKEN_MS,TPOT_MS"""
    try:
        base, per_token, tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected TTFT_BASE_MS,TTFT_PER_TOKEN_MS,TPOT_MS, not {text!r}") from None
    return SLO(per_token, tpot, base)


def run_slo(run: RunResult) -> SLO | None:
    """The SLOs a run was scored at (None: it was made without SLO flags)."""
    raw = run.summary.get("slo")
    if raw is None:
        return None
    return SLO(raw["ttft_per_token_ms"], raw["tpot_ms"], raw.get("ttft_base_ms", 0.0))


def scoring_slo(run: RunResult, slo: SLO | None) -> SLO:
    """`slo`, else the run's own; a ValueError naming `--slo` where it has none."""
    chosen = slo or run_slo(run)
    if chosen is None:
        raise ValueError(
            f"the run at {run.request_rate:g} req/s was made without SLO flags: give "
            "--slo BASE_MS,PER_TOKEN_MS,TPOT_MS to score it"
        )
    return chosen


def score_run(run: RunResult, slo: SLO | None, loose_factor: float) -> dict[str, float]:
    """One run's attainment at its SLOs (or `slo`) and at a TTFT SLO `loose_factor` times
    looser, goodput, output throughput, P90 TTFT and TPOT."""
    slo = scoring_slo(run, slo)
    loose_slo = dataclasses.replace(
        slo,
        ttft_per_token_ms=slo.ttft_per_token_ms * loose_factor,
        ttft_base_ms=slo.ttft_base_ms * loose_factor,
    )
    score = attainment(run.requests, slo)
    return {
        "set": score["attainment"],
        "loose": attainment(run.requests, loose_slo)["attainment"],
        "goodput": score["met"] / run.duration_s,
        "tok_s": run.summary["output_throughput"],
        "ttft_p90": run.summary["ttft_ms"]["p90"],
        "tpot_p90": run.summary["tpot_ms"]["p90"],
    }


def _spread(scores: list[dict[str, float]], key: str) -> str:
    """The median of `key` over the runs, with their range when there are several."""
    median = f"{statistics.median(s[key] for s in scores):.2f}"
    if len(scores) == 1:
        return median
    return f"{median} ({min(s[key] for s in scores):.2f}-{max(s[key] for s in scores):.2f})"


def sweep_table(
    results: list[BenchResult], slo: SLO | None = None, loose_factor: float = 2.0
) -> str:
    """Per configuration and rate: attainment at the runs' SLOs (or `slo`: exact for policies
    that do not read the SLO; bullet schedules by its own, so rescoring it is for comparison
    only) and at a TTFT SLO `loose_factor` times looser, goodput, output throughput, P90 TTFT
    and TPOT; then each configuration's highest rate at 90%. A rate run more than once gets the
    medians over its runs (attainment with its range), and is judged on the median."""
    if slo is None and any(run_slo(run) is None for r in results for run in r.runs):
        return latency_table(results)
    loose_name = f"TTFT SLO x{loose_factor:g}"
    lines = [
        f"| config | rate | attainment | attainment, {loose_name} | goodput (req/s) | "
        "output tok/s | P90 TTFT (ms) | P90 TPOT (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    best: dict[str, dict[str, float | None]] = {}
    repeated = False
    for result in results:
        label = result.label
        best[label] = {"set": None, "loose": None}
        by_rate: dict[float, list[dict[str, float]]] = defaultdict(list)
        for run in result.runs:
            by_rate[run.request_rate].append(score_run(run, slo, loose_factor))
        for rate, scores in by_rate.items():
            repeated |= len(scores) > 1
            row = {key: statistics.median(s[key] for s in scores) for key in scores[0]}
            for key in ("set", "loose"):
                if row[key] >= 0.9:
                    best[label][key] = max(best[label][key] or 0, rate)
            lines.append(
                f"| {label} | {rate:g} | {_spread(scores, 'set')} | {_spread(scores, 'loose')} | "
                f"{row['goodput']:.3f} | {row['tok_s']:.1f} | {row['ttft_p90']:.0f} | "
                f"{row['tpot_p90']:.0f} |"
            )
    if repeated:
        lines += ["", "Rates run more than once: medians over the runs (attainment: its range)."]
    lines += [
        "",
        f"| config | highest rate with >= 90% attainment | same, {loose_name} |",
        "| --- | ---: | ---: |",
    ]
    for label, rates in best.items():
        lines.append(
            f"| {label} | {rates['set'] or 'none tested'} | {rates['loose'] or 'none tested'} |"
        )
    return "\n".join(lines)


def latency_table(results: list[BenchResult]) -> str:
    """Per configuration and rate, throughput and latency alone: for runs made without SLO
    flags (and no --slo), which have no attainment to show."""
    lines = [
        "| config | rate | completed (req/s) | output tok/s | P90 TTFT (ms) | P90 TPOT (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        for run in result.runs:
            done = sum(r.success for r in run.requests)
            lines.append(
                f"| {result.label} | {run.request_rate:g} | {done / run.duration_s:.3f} | "
                f"{run.summary['output_throughput']:.1f} | "
                f"{run.summary['ttft_ms']['p90']:.0f} | {run.summary['tpot_ms']['p90']:.0f} |"
            )
    lines += ["", "Made without SLO flags: no attainment (give --slo to score the runs)."]
    return "\n".join(lines)


def misses_table(results: list[BenchResult], slo: SLO | None = None) -> str:
    """Per configuration and rate, the requests over their TTFT SLO, over the TPOT SLO, over
    both, and failed (at `slo`, else at each run's SLOs, as `bullet bench` scores
    attainment)."""
    lines = [
        "| config | rate | requests | TTFT missed | TPOT missed | both | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        for run in result.runs:
            scored = scoring_slo(run, slo)
            done = [r for r in run.requests if r.success]
            ttft = {r.index for r in done if r.ttft_s * 1e3 > scored.ttft_limit_ms(r.input_len)}
            tpot = {r.index for r in done if (tpot_s(r) or 0.0) * 1e3 > scored.tpot_ms}
            lines.append(
                f"| {result.label} | {run.request_rate:g} | {len(run.requests)} | {len(ttft)} | "
                f"{len(tpot)} | {len(ttft & tpot)} | {len(run.requests) - len(done)} |"
            )
    return "\n".join(lines)


def merge(paths: list[Path]) -> dict[str, BenchResult]:
    """label -> one result from several sweeps' files: the runs of every file with that label,
    one per request rate, a later file's run replacing an earlier one's at the same rate (a
    rerun), rates ascending, with the file each run came from in its config (`merged_from`)."""
    first: dict[str, BenchResult] = {}
    runs: dict[str, dict[float, RunResult]] = {}
    sources: dict[str, dict[float, str]] = {}
    for path in paths:
        result = load_result(path)
        first.setdefault(result.label, result)
        for run in result.runs:
            runs.setdefault(result.label, {})[run.request_rate] = run
            sources.setdefault(result.label, {})[run.request_rate] = str(path)
    return {
        label: dataclasses.replace(
            result,
            runs=[runs[label][rate] for rate in sorted(runs[label])],
            config=result.config
            | {"merged_from": {f"{rate:g}": sources[label][rate] for rate in sorted(runs[label])}},
        )
        for label, result in first.items()
    }
