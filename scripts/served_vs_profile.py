"""Served decode steps against the profile taken right before each run: for every
configuration and rate of a `bench_lanes_cpu.py --interleave --profile-each-run` sweep, the
median measured decode-only step at 8-15 rows on every thread (from the configuration's step
log) beside what that run's profile predicts for 12 rows at context 150.

    .venv/bin/python scripts/served_vs_profile.py docs/data/bench-cpu-28 [--labels bullet,...]

A configuration's step log covers all its rates; a rate's steps are told apart by the idle
gaps (over 10 s) between its runs, taken in the order the rates ran (ascending).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bulletserve.executor.record import StepRecord, read_step_log
from bulletserve.model.presets import get_preset
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.model import PerfModel
from bulletserve.perf.state import ExecutionState

ROWS = range(8, 16)
GAP_S = 10.0
MIN_STEPS = 100  # the warm-up request's few steps are not a run


def runs_of(step_log: Path) -> list[list[StepRecord]]:
    """The step log's records split at idle gaps; segments too short to be a run dropped."""
    try:
        steps = sorted(read_step_log(step_log), key=lambda s: s.time)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    segments: list[list[StepRecord]] = [[]]
    for step in steps:
        if segments[-1] and step.time - segments[-1][-1].time > GAP_S:
            segments.append([])
        segments[-1].append(step)
    return [s for s in segments if len(s) >= MIN_STEPS]


def runs_with_profiles(sweep: Path, label: str) -> list[tuple[float, list[StepRecord], Path]]:
    """(rate, the run's step-log records, the profile taken before it) for each run of `label`
    in the sweep, rates ascending."""
    log = sweep / f"{label}.steps.jsonl"
    profiles = {
        float(p.name.removeprefix(f"{label}.rate-").removesuffix(".profile.json")): p
        for p in sweep.glob(f"{label}.rate-*.profile.json")
    }
    runs = runs_of(log)
    if len(runs) != len(profiles):
        raise SystemExit(f"{log}: {len(runs)} runs in the step log, {len(profiles)} profiles")
    rates = sorted(profiles)
    return [(rate, steps, profiles[rate]) for rate, steps in zip(rates, runs, strict=True)]


def profile_dtype(hw: HardwareProfile, requested: str | None) -> str:
    """The dtype to predict in: `requested`, else the one the profile measured."""
    if requested:
        return requested
    if len(hw.peak_flops) != 1:
        raise SystemExit(f"the profile has {sorted(hw.peak_flops)}: pass --dtype")
    return next(iter(hw.peak_flops))


def is_full_decode(step: StepRecord, total_units: int) -> bool:
    return (
        step.lane == "decode"
        and step.prefill_tokens == 0
        and step.decode_rows in ROWS
        and step.split in ((0, total_units), (total_units, total_units))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--labels", default="bullet,prefill-first,chunked-512")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", help="default: the dtype the profiles measured")
    args = parser.parse_args()
    cfg = get_preset(args.model)
    print("| config | rate | served ms (steps) | profile before ms | served / profile |")
    print("|---|---:|---:|---:|---:|")
    for label in args.labels.split(","):
        if not (args.sweep / f"{label}.steps.jsonl").exists():
            continue
        for rate, steps, profile in runs_with_profiles(args.sweep, label):
            hw = HardwareProfile.load(profile)
            served = [s.measured_s * 1e3 for s in steps if is_full_decode(s, hw.units)]
            es = ExecutionState(decode_ctx=(150,) * 12, decode_units=hw.units)
            predicted = PerfModel(cfg, hw, profile_dtype(hw, args.dtype)).predict(es).decode_s * 1e3
            if not served:
                continue
            median = statistics.median(served)
            print(
                f"| {label} | {rate:g} | {median:.1f} ({len(served)}) | {predicted:.1f} | "
                f"{median / predicted:.2f} |"
            )


if __name__ == "__main__":
    main()
