"""The report of scripts/prefill_gap_server.sh: per run, served single prompts under 32 tokens
and decode steps of 8-15 rows, each against the quick profile taken before the run's pair.

    .venv/bin/python scripts/prefill_gap_report.py docs/data/prefill-gap-2026-11-30 [--mode idle]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bulletserve.bench.records import load_result
from bulletserve.model.presets import get_preset
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.model import PerfModel
from bulletserve.perf.state import ExecutionState

RUNS = (("default", 1), ("fast", 1), ("default2", 2), ("fast2", 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=("switch", "idle"), default="switch")
    args = parser.parse_args()
    second = "0.5 ms switch interval" if args.mode == "switch" else "beside two idle servers"
    cfg = get_preset("smollm2-135m")
    print(
        "| run | setting | prefills < 32 tokens: served / predicted ms (n) | "
        "decode 8-15 rows: served / predicted ms (n) | attainment | mean TTFT ms |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, pair in RUNS:
        hw = HardwareProfile.load(args.out / f"profile-{pair}.json")
        perf = PerfModel(cfg, hw, "bfloat16")
        steps = [
            json.loads(x) for x in (args.out / f"{label}.steps.jsonl").read_text().split("\n") if x
        ]
        prefills = [
            (
                s["measured_s"],
                perf.predict(
                    ExecutionState(prefill_lens=(s["prefill_tokens"],), prefill_units=hw.units)
                ).prefill_s,
            )
            for s in steps
            if s["batch_size"] == 1 and s["decode_seqs"] == 0 and 0 < s["prefill_tokens"] < 32
        ]
        decodes = [
            (
                s["measured_s"],
                perf.predict(
                    ExecutionState(decode_ctx=(150,) * s["decode_seqs"], decode_units=hw.units)
                ).decode_s,
            )
            for s in steps
            if s["prefill_tokens"] == 0 and 8 <= s["decode_seqs"] < 16
        ]
        summary = load_result(args.out / f"{label}.json").runs[0].summary
        cells = []
        for pairs in (prefills, decodes):
            served = statistics.median(m for m, _ in pairs) * 1e3
            predicted = statistics.median(p for _, p in pairs) * 1e3
            cells.append(f"{served:.1f} / {predicted:.1f} ({len(pairs)})")
        setting = "alone, 5 ms switch interval" if label.startswith("default") else second
        print(
            f"| {label} | {setting} | {cells[0]} | {cells[1]} | "
            f"{summary['slo']['attainment']:.2f} | {summary['ttft_ms']['mean']:.0f} |"
        )


if __name__ == "__main__":
    main()
