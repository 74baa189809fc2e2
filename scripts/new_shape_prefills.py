"""What a prefill pays the first time its prompt length is seen, on a CPU: oneDNN builds a GEMM
primitive per row count and caches it (1,024 entries), so a new length runs its first step
with new primitives. For each length in each range the profiler's single step of that prefill
runs twice in a row, in one process; the first time is the new shape, the second the cached
one (the profile's rounds time only cached shapes). `--warmup-rows N` first builds the kernels
of every padded row count up to N as an engine does at start (`warm_cpu_gemms`), on each of
`--threads`, the thread counts the prefills then run on.

    .venv/bin/python scripts/new_shape_prefills.py [--ranges 17-57:2,200-400:10] \
        [--warmup-rows 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bulletserve.engine.llm import LLM
from bulletserve.engine.runner import warm_cpu_gemms
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
    parser.add_argument("--warmup-rows", type=int, default=0)
    parser.add_argument("--threads", default=None, help="comma-separated (default: all cores)")
    args = parser.parse_args()
    engine = LLM(policy="prefill-first", max_model_len=768, cpu_warmup_rows=0).engine
    bench = StepBench(engine.model, unit_provider(engine.device), 4096)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [bench.units.total]

    def prefill_ms(tokens: int, count: int) -> float:
        with torch.inference_mode():
            return bench._once(bench.prefill_works([tokens]), count) * 1e3

    prefill_ms(16, threads[0])  # the first step of a process pays more than a new shape
    if args.warmup_rows:
        warm_cpu_gemms(engine.model, args.warmup_rows, args.warmup_rows, threads)
    print("| threads | prompt tokens | lengths | first time ms | again ms | first - again ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for count in threads:
        for lengths in args.ranges:
            first, again = [], []
            for tokens in lengths:
                first.append(prefill_ms(tokens, count))
                again.append(prefill_ms(tokens, count))
            extra = statistics.median(a - b for a, b in zip(first, again, strict=True))
            print(
                f"| {count} | {lengths.start}-{lengths.stop - 1} | {len(lengths)} | "
                f"{statistics.median(first):.1f} | {statistics.median(again):.1f} | {extra:.1f} |"
            )
    engine.close()


if __name__ == "__main__":
    main()
