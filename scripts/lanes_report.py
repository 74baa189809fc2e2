"""The lanes benchmark's table for docs/benchmarks.md, from `bullet bench` result files.

Per configuration and rate: SLO attainment at the run's SLOs (or at `--slo`, recomputed from the
per-request records) and at a looser TTFT SLO (a sensitivity check), goodput (requests/s meeting
both SLOs), output throughput, P90 TTFT and TPOT; then the highest rate that keeps 90%. A rate
run more than once (`bench_lanes_cpu.py --repeats`) gets the medians over its runs, and the
highest rate is judged on the median attainment.

    python scripts/lanes_report.py docs/data/bench-cpu/*.json --loose-ttft-factor 2
    python scripts/lanes_report.py RUNS.json --slo 143.2,1.991,164.6

Rescoring with `--slo` is exact for policies that do not read the SLO (chunked,
prefill-first); bullet schedules by its SLOs, so its runs are rescored only for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections import defaultdict
from pathlib import Path

from bulletserve.bench.metrics import SLO, attainment
from bulletserve.bench.records import RunResult, load_result


def parse_slo(text: str) -> SLO:
    """TTFT_BASE_MS,TTFT_PER_TOKEN_MS,TPOT_MS"""
    try:
        base, per_token, tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--slo wants TTFT_BASE_MS,TTFT_PER_TOKEN_MS,TPOT_MS, not {text!r}"
        ) from None
    return SLO(per_token, tpot, base)


def score_run(run: RunResult, slo: SLO | None, loose_factor: float) -> dict[str, float]:
    """One run's attainment at its SLOs (or `slo`) and at a TTFT SLO `loose_factor` times
    looser, goodput, output throughput, P90 TTFT and TPOT."""
    ran = run.summary["slo"]
    slo = slo or SLO(ran["ttft_per_token_ms"], ran["tpot_ms"], ran.get("ttft_base_ms", 0.0))
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


def spread(scores: list[dict[str, float]], key: str) -> str:
    """The median of `key` over the runs, with their range when there are several."""
    median = f"{statistics.median(s[key] for s in scores):.2f}"
    if len(scores) == 1:
        return median
    return f"{median} ({min(s[key] for s in scores):.2f}-{max(s[key] for s in scores):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--loose-ttft-factor", type=float, default=2.0)
    parser.add_argument(
        "--slo", type=parse_slo, help="rescore at TTFT_BASE_MS,PER_TOKEN_MS,TPOT_MS"
    )
    args = parser.parse_args()
    best: dict[str, dict[str, float | None]] = {}
    loose_name = f"TTFT SLO x{args.loose_ttft_factor:g}"
    print(
        f"| config | rate | attainment | attainment, {loose_name} | goodput (req/s) | "
        "output tok/s | P90 TTFT (ms) | P90 TPOT (ms) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    repeated = False
    for path in args.results:
        result = load_result(path)
        label = result.label
        best[label] = {"set": None, "loose": None}
        by_rate: dict[float, list[dict[str, float]]] = defaultdict(list)
        for run in result.runs:
            by_rate[run.request_rate].append(score_run(run, args.slo, args.loose_ttft_factor))
        for rate, scores in by_rate.items():
            repeated |= len(scores) > 1
            row = {key: statistics.median(s[key] for s in scores) for key in scores[0]}
            for key in ("set", "loose"):
                if row[key] >= 0.9:
                    best[label][key] = max(best[label][key] or 0, rate)
            print(
                f"| {label} | {rate:g} | {spread(scores, 'set')} | {spread(scores, 'loose')} | "
                f"{row['goodput']:.3f} | {row['tok_s']:.1f} | {row['ttft_p90']:.0f} | "
                f"{row['tpot_p90']:.0f} |"
            )
    if repeated:
        print()
        print("Rates run more than once: medians over the runs (attainment: median and range).")
    print()
    print(f"| config | highest rate with >= 90% attainment | same, {loose_name} |")
    print("| --- | ---: | ---: |")
    for label, rates in best.items():
        print(f"| {label} | {rates['set'] or 'none tested'} | {rates['loose'] or 'none tested'} |")


if __name__ == "__main__":
    main()
