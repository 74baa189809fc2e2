"""Summarize a `--step-log` file: time per lane and split, the steps per rule of the bullet
policy that chose their split, step latency, prediction error, and the decode lane's steps by
batch size (runner time, and the host's time between one
whole-device decode step's end and the next one's start).

python scripts/analyze_step_log.py docs/data/bench-cpu/bullet.steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from itertools import pairwise
from pathlib import Path


def summarize(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    busy: dict[str, float] = defaultdict(float)
    by_split: dict[tuple[str, tuple[int, int]], list[float]] = defaultdict(list)
    errors: dict[str, list[float]] = defaultdict(list)
    sizes: dict[str, list[int]] = defaultdict(list)
    rules: dict[str, int] = defaultdict(int)
    for r in records:
        busy[r["lane"]] += r["measured_s"]
        by_split[(r["lane"], tuple(r["split"]))].append(r["measured_s"])
        if r.get("rule"):  # logs from before the rule was logged have none
            rules[f"{r['lane']} {r['rule']} {r['split'][0]}/{r['split'][1]}"] += 1
        sizes[r["lane"]].append(r.get("tokens", r.get("batch_size", 0)))
        if r["measured_s"] > 0 and "predicted_s" in r:  # the single-lane engine predicts none
            errors[r["lane"]].append(abs(r["predicted_s"] / r["measured_s"] - 1))
    span = records[-1]["time"] - records[0]["time"]
    return {
        "decode_by_batch": decode_by_batch(records),
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
        "steps_by_rule": dict(sorted(rules.items())),
        "median_tokens_per_step": {lane: statistics.median(v) for lane, v in sizes.items()},
        "median_abs_prediction_error": {lane: statistics.median(v) for lane, v in errors.items()},
    }


def whole_device_decodes(records: list[dict]) -> list[tuple[dict, float]]:
    """Decode steps that had every unit (no prefill beside them) and that another such step
    follows, each with the gap (s) from its end to the next one's start (a step's `time` is
    logged at its end)."""
    records = sorted(records, key=lambda r: r["time"])
    return [
        (step, after["time"] - after["measured_s"] - step["time"])
        for step, after in pairwise(records)
        if step["lane"] == after["lane"] == "decode" and step["split"][0] == after["split"][0] == 0
    ]


def runner_s(step: dict) -> float:
    """The model's own time in a step: `runner_s` where the log has it (a lane's step), else
    the step (the single-lane engine logs its runner call as the step)."""
    return step.get("runner_s", step["measured_s"])


def decode_by_batch(records: list[dict], width: int = 4) -> dict[str, dict[str, float]]:
    """Median step ms, runner ms and gap ms to the next step of `whole_device_decodes`, in
    batch-size bins of `width`. The step is `measured_s` (for a lane: from the plan's end to
    the step's end, with the hand-off to the thread that runs the model)."""
    bins: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for step, gap in whole_device_decodes(records):
        bins[step["batch_size"] // width].append((step["measured_s"], runner_s(step), gap))
    return {
        f"{b * width}-{b * width + width - 1}": {
            "steps": len(v),
            "step_ms": statistics.median(m for m, _, _ in v) * 1e3,
            "runner_ms": statistics.median(r for _, r, _ in v) * 1e3,
            "gap_ms": statistics.median(g for _, _, g in v) * 1e3,
        }
        for b, v in sorted(bins.items())
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
