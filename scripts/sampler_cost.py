"""Time `Sampler.sample` on random logits: greedy, temperature 1, and temperature 0.7 with
top-p 0.9, for a few batch sizes and two vocabularies (SmolLM2's 49,152 and Llama 3's 128,256).

    python scripts/sampler_cost.py [--device cpu|cuda] [--threads 2] [--repeats 7]

Prints the median milliseconds of each case. Run it from two checkouts to compare samplers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bulletserve.engine.request import Request, RequestTimings
from bulletserve.engine.sampler import Sampler
from bulletserve.engine.sampling_params import SamplingParams

CASES = {
    "greedy": {"temperature": 0.0},
    "t=1": {"temperature": 1.0},
    "t=0.7,top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sampler = Sampler(seed=0)
    print(f"{'vocab':>7} {'rows':>5} {'case':>16} {'ms':>9}")
    for vocab in (49152, 128256):
        for rows in (1, 16, 100):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
            logits = logits.to(args.device)
            for name, params in CASES.items():
                requests = [
                    Request(
                        str(i),
                        None,
                        [1],
                        SamplingParams(max_tokens=1, **params),
                        RequestTimings(0.0),
                    )
                    for i in range(rows)
                ]
                stops = [frozenset()] * rows
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    sampler.sample(logits, requests, stops)
                    times.append(time.perf_counter() - start)
                print(f"{vocab:>7} {rows:>5} {name:>16} {statistics.median(times) * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
