"""How much a fastest-round rule (`bullet profile`'s until it kept the median round) flatters a
step: a few decode and prefill shapes of the default model, on every thread, timed round after
round (the shapes interleaved, as the profile does), each shape's median round against the
fastest of three consecutive rounds (the default sweep's rounds).

    .venv/bin/python scripts/profile_rounds.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bulletserve.engine.engine import resolve_device
from bulletserve.model.loader import load_model, resolve_dtype
from bulletserve.model.source import resolve_model
from bulletserve.partition import unit_provider
from bulletserve.perf.measure.steps import StepBench
from bulletserve.perf.state import ExecutionState

CONTEXT = 300
DECODE_BATCHES = (4, 16, 48)
PREFILL_LENS = (64, 256)
PROFILE_ROUNDS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="a multiple of 3")
    args = parser.parse_args()
    device = resolve_device("cpu")
    units = unit_provider(device)
    model = load_model(
        resolve_model(None, "auto"), resolve_dtype("auto", device), device, 1024, seed=0
    )
    full = units.total
    states = [ExecutionState(decode_ctx=(CONTEXT,) * b, decode_units=full) for b in DECODE_BATCHES]
    states += [ExecutionState(prefill_lens=(n,), prefill_units=full) for n in PREFILL_LENS]
    times: list[list[float]] = [[] for _ in states]
    with torch.inference_mode():
        bench = StepBench(model, units, max(DECODE_BATCHES) * CONTEXT + max(PREFILL_LENS))
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for i, es in enumerate(states):
                prefill, decode = bench.state_works(es)
                seconds = bench._once(prefill if es.has_prefill else decode, full)
                if round_:
                    times[i].append(seconds)
    print("| step | median round ms | fastest of 3, per 3 rounds (ms) | median / fastest of 3 |")
    print("|---|---:|---|---:|")
    for es, t in zip(states, times, strict=True):
        fastest = [min(t[k : k + PROFILE_ROUNDS]) for k in range(0, len(t), PROFILE_ROUNDS)]
        name = f"decode x{es.decode_batch}" if es.has_decode else f"prefill {es.prefill_tokens}"
        ratio = statistics.median(t) / statistics.median(fastest)
        listed = " ".join(f"{f * 1e3:.1f}" for f in fastest)
        print(f"| {name} | {statistics.median(t) * 1e3:.1f} | {listed} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
