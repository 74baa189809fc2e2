"""A served run's steps replayed through the model runner in fresh processes, with a CPU step's
rows padded and their GEMM kernels built first (the engine's default since the eleventh
session) against rows as they come and kernels built when first met (before it): how long the
same sequence of step shapes takes each way, the kernels' start-up cost apart.

The step log gives each step's prompt tokens, prompts and decoding rows (not their contexts):
a prefill of n tokens over p prompts replays as p prompts of about n / p tokens, decode rows
at a context of `--context` tokens. Each replay runs in a process of its own (oneDNN's kernel
cache is per process), the two ways alternating, `--repeats` times each.

    .venv/bin/python scripts/replay_step_rows.py docs/data/bench-cpu-33/prefill-first.steps.jsonl \
        [--steps 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def step_shapes(log: Path, count: int) -> list[tuple[list[int], int]]:
    """(prompt lengths, decode rows) of the log's first `count` steps, in order."""
    shapes = []
    for line in log.read_text().splitlines()[:count]:
        step = json.loads(line)
        prompts = step["batch_size"] - step.get("decode_seqs", 0)
        tokens = step.get("prefill_tokens", 0)
        lens = (
            [tokens // prompts + (i < tokens % prompts) for i in range(prompts)] if tokens else []
        )
        shapes.append((lens, step.get("decode_seqs", 0)))
    return shapes


def replay(shapes: list[tuple[list[int], int]], padded: bool, context: int) -> dict:
    """Run the steps once in this process; seconds for the warm-up and for the steps."""
    import torch

    from bulletserve.engine.llm import LLM
    from bulletserve.engine.runner import warm_cpu_gemms
    from bulletserve.partition import unit_provider
    from bulletserve.perf.measure.steps import StepBench

    engine = LLM(policy="prefill-first", max_model_len=768, cpu_warmup_rows=0).engine
    bench = StepBench(engine.model, unit_provider(engine.device), 16384)
    runner = bench._runners[0]
    runner.pad_rows = padded
    started = time.perf_counter()
    if padded:
        warm_cpu_gemms(engine.model, 256, 256, [torch.get_num_threads()])
    warmup_s = time.perf_counter() - started
    step_s = []
    with torch.inference_mode():
        for lens, rows in shapes:
            works = bench.prefill_works(lens) if lens else []
            works += bench.decode_works(rows, context) if rows else []
            start = time.perf_counter()
            runner.execute(works)
            step_s.append(time.perf_counter() - start)
            bench._free(works)
    return {"warmup_s": warmup_s, "steps_s": sum(step_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--child", choices=("padded", "exact"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = step_shapes(args.log, args.steps)
    if args.child:
        print(json.dumps(replay(shapes, args.child == "padded", args.context)))
        return
    results: dict[str, list[dict]] = {"exact": [], "padded": []}
    for i in range(args.repeats):
        for mode in ("exact", "padded") if i % 2 == 0 else ("padded", "exact"):
            cli = [sys.executable, __file__, str(args.log), "--steps", str(args.steps)]
            cli += ["--context", str(args.context), "--child", mode]
            out = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
            results[mode].append(json.loads(out.splitlines()[-1]))
            print(mode, results[mode][-1], flush=True)
    ratios = [
        p["steps_s"] / e["steps_s"]
        for p, e in zip(results["padded"], results["exact"], strict=True)
    ]
    print(f"{len(shapes)} steps of {args.log}")
    print("| way | steps s (each replay) | median | warm-up s (median) |")
    print("|---|---|---:|---:|")
    for mode, name in (
        ("exact", "exact rows, kernels when met"),
        ("padded", "padded, built first"),
    ):
        times = [r["steps_s"] for r in results[mode]]
        warm = statistics.median(r["warmup_s"] for r in results[mode])
        each = ", ".join(f"{t:.2f}" for t in times)
        print(f"| {name} | {each} | {statistics.median(times):.2f} | {warm:.2f} |")
    print(f"padded / exact, replay by replay: {', '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
