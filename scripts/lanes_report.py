"""The lanes benchmark's table for docs/benchmarks.md, from `bullet bench` result files.

Per configuration and rate: SLO attainment at the benchmark's SLOs and at a looser TTFT SLO
(a sensitivity check, recomputed from the per-request records), goodput (requests/s meeting
both SLOs), output throughput, P90 TTFT and TPOT; then the highest rate that keeps 90%.

    python scripts/lanes_report.py docs/data/bench-cpu/*.json --loose-ttft-factor 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def attained(request: dict, ttft_per_token_ms: float, tpot_ms: float) -> bool:
    if not request["success"] or request["ttft_s"] is None:
        return False
    # TPOT as vLLM defines it: after the first token; one-token requests have none.
    tpot = None
    if request["output_len"] > 1:
        tpot = (request["e2el_s"] - request["ttft_s"]) / (request["output_len"] - 1)
    ttft_ok = request["ttft_s"] * 1e3 / request["input_len"] <= ttft_per_token_ms
    return ttft_ok and (tpot is None or tpot * 1e3 <= tpot_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--loose-ttft-factor", type=float, default=2.0)
    args = parser.parse_args()
    best: dict[str, dict[str, float | None]] = {}
    loose_name = f"TTFT SLO x{args.loose_ttft_factor:g}"
    print(
        f"| config | rate | attainment | attainment, {loose_name} | goodput (req/s) | "
        "output tok/s | P90 TTFT (ms) | P90 TPOT (ms) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in args.results:
        data = json.loads(path.read_text())
        label = data["label"]
        best[label] = {"set": None, "loose": None}
        for run in data["runs"]:
            s, rate = run["summary"], run["request_rate"]
            slo = s["slo"]
            ttft_slo, tpot_slo = slo["ttft_per_token_ms"], slo["tpot_ms"]
            loose = sum(
                attained(r, ttft_slo * args.loose_ttft_factor, tpot_slo) for r in run["requests"]
            ) / len(run["requests"])
            goodput = slo["met"] / run["duration_s"]
            for key, value in (("set", slo["attainment"]), ("loose", loose)):
                if value >= 0.9:
                    best[label][key] = max(best[label][key] or 0, rate)
            print(
                f"| {label} | {rate:g} | {slo['attainment']:.2f} | {loose:.2f} | {goodput:.3f} | "
                f"{s['output_throughput']:.1f} | {s['ttft_ms']['p90']:.0f} | "
                f"{s['tpot_ms']['p90']:.0f} |"
            )
    print()
    print(f"| config | highest rate with >= 90% attainment | same, {loose_name} |")
    print("| --- | ---: | ---: |")
    for label, rates in best.items():
        print(f"| {label} | {rates['set'] or 'none tested'} | {rates['loose'] or 'none tested'} |")


if __name__ == "__main__":
    main()
