"""Served single-prompt prefills on every thread against the profile taken right before each
run, by prompt size: for a `bench_lanes_cpu.py --interleave --profile-each-run` sweep, each
prefill step of one prompt that ran alone (no decode rows in it, no decode lane beside it)
beside the run's own profile's prediction for that prompt.

    .venv/bin/python scripts/served_prefills_vs_profile.py docs/data/bench-cpu-30 \
        [--labels bullet,prefill-first] [--padded]

A second table splits the same steps by whether the server had run a step of that many rows on
that many threads before (oneDNN builds a GEMM kernel for each new pair, engine/runner.py).
`--padded`: the sweep's servers padded their steps' rows (`padded_rows`, from 2026-11-30's
eleventh session on), so rows are counted padded.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from served_vs_profile import profile_dtype, runs_with_profiles

from bulletserve.engine.runner import padded_rows
from bulletserve.model.presets import get_preset
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.model import PerfModel
from bulletserve.perf.state import ExecutionState

BUCKETS = ((0, 32), (32, 64), (64, 128), (128, 1 << 20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--labels", default="bullet,prefill-first")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--padded", action="store_true")
    parser.add_argument("--dtype", help="default: the dtype the profiles measured")
    args = parser.parse_args()
    cfg = get_preset(args.model)
    # bucket -> (served / predicted, served ms, predicted ms) per step
    buckets: dict[tuple[int, int], list[tuple[float, float, float]]] = defaultdict(list)
    met: dict[bool, list[tuple[float, float, float]]] = defaultdict(list)
    for label in args.labels.split(","):
        seen: set[tuple[int, int]] = set()  # (rows, threads) the label's server has run
        for _, steps, profile in runs_with_profiles(args.sweep, label):
            hw = HardwareProfile.load(profile)
            perf = PerfModel(cfg, hw, profile_dtype(hw, args.dtype))
            for s in steps:
                shape = step_shape(s, hw.units, args.padded)
                before = shape in seen
                seen.add(shape)
                alone = s["split"] == [hw.units, 0] and s.get("decode_seqs", 0) == 0
                if s["lane"] != "prefill" or s["batch_size"] != 1 or not alone:
                    continue
                tokens = s.get("prefill_tokens", s["tokens"])
                es = ExecutionState(prefill_lens=(tokens,), prefill_units=hw.units)
                predicted = perf.predict(es).prefill_s
                bucket = next(b for b in BUCKETS if b[0] <= tokens < b[1])
                sample = (s["measured_s"] / predicted, s["measured_s"], predicted)
                buckets[bucket].append(sample)
                met[before].append(sample)
    print("| prompt tokens | steps | served ms | predicted ms | served / predicted |")
    print("|---|---:|---:|---:|---:|")
    for low, high in BUCKETS:
        rows = buckets[(low, high)]
        if rows:
            size = f"{low}-{high - 1}" if high < 1 << 20 else f"{low}+"
            ratio, served, predicted = (statistics.median(r[i] for r in rows) for i in range(3))
            print(
                f"| {size} | {len(rows)} | {served * 1e3:.1f} | {predicted * 1e3:.1f} | "
                f"{ratio:.2f} |"
            )

    print()
    print("| rows on those threads | steps | served ms | predicted ms | served / predicted |")
    print("|---|---:|---:|---:|---:|")
    for before, name in ((False, "first met"), (True, "met before")):
        if met[before]:
            ratio, served, predicted = (
                statistics.median(r[i] for r in met[before]) for i in range(3)
            )
            print(
                f"| {name} | {len(met[before])} | {served * 1e3:.1f} | {predicted * 1e3:.1f} | "
                f"{ratio:.2f} |"
            )


def step_shape(step: dict, total_units: int, padded: bool) -> tuple[int, int]:
    """(rows, threads) of a step's GEMMs: its tokens (padded as the engine pads them) on its
    lane's threads (a lane with no units of its own had them all)."""
    rows = padded_rows(step["tokens"]) if padded else step["tokens"]
    threads = step["split"][0 if step["lane"] == "prefill" else 1] or total_units
    return rows, threads


if __name__ == "__main__":
    main()
