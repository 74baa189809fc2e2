"""Summarize a `--step-log` file: time per lane and split, step latency, prediction error.

python scripts/analyze_step_log.py docs/data/bench-cpu/bullet.steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def summarize(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    busy: dict[str, float] = defaultdict(float)
    by_split: dict[tuple[str, tuple[int, int]], list[float]] = defaultdict(list)
    errors: dict[str, list[float]] = defaultdict(list)
    sizes: dict[str, list[int]] = defaultdict(list)
    for r in records:
        busy[r["lane"]] += r["measured_s"]
        by_split[(r["lane"], tuple(r["split"]))].append(r["measured_s"])
        sizes[r["lane"]].append(r.get("tokens", r.get("batch_size", 0)))
        if r["measured_s"] > 0:
            errors[r["lane"]].append(abs(r["predicted_s"] / r["measured_s"] - 1))
    span = records[-1]["time"] - records[0]["time"]
    return {
        "span_s": span,
        "lane_busy_fraction": {lane: t / span for lane, t in busy.items()},
        "steps": {
            f"{lane} split {split[0]}/{split[1]}": {
                "count": len(times),
                "seconds": sum(times),
                "median_ms": statistics.median(times) * 1e3,
            }
            for (lane, split), times in sorted(by_split.items())
        },
        "median_tokens_per_step": {lane: statistics.median(v) for lane, v in sizes.items()},
        "median_abs_prediction_error": {lane: statistics.median(v) for lane, v in errors.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step_logs", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.step_logs:
        print(path)
        print(json.dumps(summarize(path), indent=2))


if __name__ == "__main__":
    main()
