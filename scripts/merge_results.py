"""One `bullet bench` result per configuration from several sweeps' files: the runs of every
file with the same label, one per request rate, a later file's run replacing an earlier one's at
the same rate (a rerun), rates ascending; each written as OUT/LABEL.json with the files it came
from in its config (`merged_from`).

    python scripts/merge_results.py --out docs/data/bench-cpu-52-54 \\
        docs/data/bench-cpu-52/*.rate-*.json docs/data/bench-cpu-5{3,4}/*.rate-*.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bulletserve.bench.records import BenchResult, RunResult, load_result


def merge(paths: list[Path]) -> dict[str, BenchResult]:
    """label -> the merged result."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for label, result in merge(args.results).items():
        path = args.out / f"{label}.json"
        result.save(path)
        rates = ", ".join(f"{run.request_rate:g}" for run in result.runs)
        print(f"{path}: {label}, rates {rates}")


if __name__ == "__main__":
    main()
