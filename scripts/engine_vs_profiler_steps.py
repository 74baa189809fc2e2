"""Decode steps as `bullet profile` times them against the same shape in an offline engine, in
one process: the profiler's single steps (fastest and median of `--repeats`) at a few contexts,
then `--batch` sequences generated under prefill-first with a step log, whose decode-only steps
at that batch give the engine's median. A gap between the two is the engine's own (input
preparation, sampling, the step loop), not the server's or the machine's hour.

    .venv/bin/python scripts/engine_vs_profiler_steps.py [--batch 8] [--tokens 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bulletserve.engine.engine import resolve_device
from bulletserve.engine.llm import LLM
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.model.loader import load_model, resolve_dtype
from bulletserve.model.source import resolve_model
from bulletserve.partition import unit_provider
from bulletserve.perf.measure.steps import StepBench

PROMPT_TOKENS = 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100, help="tokens generated per sequence")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    device = resolve_device("cpu")
    units = unit_provider(device)
    model = load_model(
        resolve_model(None, "auto"), resolve_dtype("auto", device), device, 1024, seed=0
    )
    bench = StepBench(model, units, args.batch * (PROMPT_TOKENS + args.tokens) + 64)
    contexts = (PROMPT_TOKENS, PROMPT_TOKENS + args.tokens // 2, PROMPT_TOKENS + args.tokens)
    with torch.inference_mode():
        # `_once`: one step per call, exactly as `StepBench.measure` times a round.
        for ctx in contexts:
            times = [
                bench._once(bench.decode_works(args.batch, ctx), units.total) * 1e3
                for _ in range(args.repeats)
            ]
            print(
                f"profiler, decode x{args.batch} at context {ctx}: "
                f"fastest {min(times):.1f} ms, median {statistics.median(times):.1f} ms"
            )
    del bench, model
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        llm = LLM(policy="prefill-first", step_log=str(log))
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(100, 40_000, (PROMPT_TOKENS,), generator=gen).tolist()
            for _ in range(args.batch)
        ]
        params = SamplingParams(max_tokens=args.tokens, temperature=0.8, ignore_eos=True)
        llm.generate(prompts, params)
        llm.engine.close()
        steps = [json.loads(line) for line in log.read_text().splitlines()]
    decode = [
        s["measured_s"] * 1e3
        for s in steps
        if s["decode_seqs"] == args.batch and s["prefill_tokens"] == 0
    ]
    print(
        f"engine, decode x{args.batch} over contexts {contexts[0]}-{contexts[-1]}: "
        f"{len(decode)} steps, fastest {min(decode):.1f} ms, "
        f"median {statistics.median(decode):.1f} ms"
    )


if __name__ == "__main__":
    main()
