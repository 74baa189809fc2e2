"""What a prefill pays the first time its prompt length is seen, on a CPU: oneDNN builds a GEMM
primitive per row count and caches it (1,024 entries), so a new length runs its first step
with new primitives. For each length in each range the profiler's single step of that prefill
runs twice in a row, in one process; the first time is the new shape, the second the cached
one (the profile's rounds time only cached shapes).

    .venv/bin/python scripts/new_shape_prefills.py [--ranges 17-57:2,200-400:10]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bulletserve.engine.llm import LLM
from bulletserve.partition import unit_provider
from bulletserve.perf.measure.steps import StepBench


def parse_ranges(text: str) -> list[range]:
    """`LOW-HIGH:STEP,...` as ranges of prompt lengths."""
    ranges = []
    for part in text.split(","):
        span, _, step = part.partition(":")
        low, _, high = span.partition("-")
        ranges.append(range(int(low), int(high), int(step or 1)))
    return ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranges", default="17-57:2,200-400:10", type=parse_ranges)
    args = parser.parse_args()
    engine = LLM(policy="prefill-first", max_model_len=768).engine
    bench = StepBench(engine.model, unit_provider(engine.device), 4096)

    def prefill_ms(tokens: int) -> float:
        with torch.inference_mode():
            return bench._once(bench.prefill_works([tokens]), bench.units.total) * 1e3

    prefill_ms(16)  # the first step of a process pays more than a new shape
    print("| prompt tokens | lengths | first time ms | again ms | first - again ms |")
    print("|---|---:|---:|---:|---:|")
    for lengths in args.ranges:
        first, again = [], []
        for tokens in lengths:
            first.append(prefill_ms(tokens))
            again.append(prefill_ms(tokens))
        extra = statistics.median(a - b for a, b in zip(first, again, strict=True))
        print(
            f"| {lengths.start}-{lengths.stop - 1} | {len(lengths)} | "
            f"{statistics.median(first):.1f} | {statistics.median(again):.1f} | {extra:.1f} |"
        )
    engine.close()


if __name__ == "__main__":
    main()
