"""Short prefills in an offline engine against the profiler's timing of the same prompt, in
one process: `--arrivals` prompts of `--tokens` tokens arrive one by one while 8 sequences
decode under prefill-first (the served pattern: a new prompt between decode steps), and after
each the profiler's single step of that prefill runs. A gap between the two medians is the
engine's; none means what served prefills pay on top comes with the server.

    .venv/bin/python scripts/engine_prefills_vs_profiler.py [--tokens 20] [--arrivals 25]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bulletserve.engine.llm import LLM
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.partition import unit_provider
from bulletserve.perf.measure.steps import StepBench

DECODING = 8
STEPS_PER_ARRIVAL = 3  # the new prompt's prefill, then decode steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--arrivals", type=int, default=25)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, 40_000, (n,), generator=gen).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        engine = LLM(policy="prefill-first", step_log=str(log), max_model_len=768).engine
        decoding = SamplingParams(max_tokens=400, temperature=0.8, ignore_eos=True)
        arriving = SamplingParams(max_tokens=2, temperature=0.8, ignore_eos=True)
        for _ in range(DECODING):
            engine.add_request(prompt(60), decoding)
        for _ in range(STEPS_PER_ARRIVAL):
            engine.step()
        bench = StepBench(engine.model, unit_provider(engine.device), 4096)
        profiler = []
        for _ in range(args.arrivals):
            engine.add_request(prompt(args.tokens), arriving)
            for _ in range(STEPS_PER_ARRIVAL):
                engine.step()
            with torch.inference_mode():
                # `_once`: one step per call, exactly as `StepBench.measure` times a round.
                works = bench.prefill_works([args.tokens])
                profiler.append(bench._once(works, bench.units.total) * 1e3)
        engine.close()
        steps = [json.loads(line) for line in log.read_text().splitlines()]
    served = [
        s["measured_s"] * 1e3
        for s in steps
        if s["prefill_tokens"] == args.tokens and s["decode_seqs"] == 0
    ]
    print(
        f"engine: {len(served)} prefills of {args.tokens} tokens, median "
        f"{statistics.median(served):.1f} ms; profiler, interleaved: median "
        f"{statistics.median(profiler):.1f} ms"
    )


if __name__ == "__main__":
    main()
