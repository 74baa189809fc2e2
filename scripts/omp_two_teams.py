"""Does a second OpenMP team slow this thread's parallel ops? (Bullet's two lane threads each
lead one on a CPU.)

Times a loop of two small parallel ops (an in-place multiply of 200,000 floats and an 8 x 576
x 576 bf16 matmul) on 2 threads, alternately alone and while another thread that has led a
2-thread team waits idle, --rounds times, and prints the medians in microseconds per iteration.
With --decode it times the default model's decode steps instead (prefill-first, 32 prompts of
128 token ids, 24 greedy tokens, dummy weights; median ms of the 32-row decode steps).

    .venv/bin/python scripts/omp_two_teams.py --rounds 6 [--decode]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial

# isort: off
import bulletserve  # noqa: F401  (sets the server's OpenMP wait policy before torch loads)
import torch

# isort: on
from decode_timing import decode_step_timer

ITERATIONS = 20_000


def _loop(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        y.mul_(1.0000001)
        torch.mm(x, w)
    return (time.perf_counter() - start) / ITERATIONS * 1e6


def _lead_a_team_then_wait(stop: threading.Event, x: torch.Tensor, w: torch.Tensor) -> None:
    torch.set_num_threads(2)
    torch.randn(200_000).mul_(1.1)
    torch.mm(x, w)
    stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--decode", action="store_true", help="time model decode steps")
    args = parser.parse_args()
    torch.set_num_threads(2)
    y = torch.randn(200_000)
    x = torch.randn(8, 576, dtype=torch.bfloat16)
    w = torch.randn(576, 576, dtype=torch.bfloat16)
    if args.decode:
        measure = decode_step_timer("prefill-first", "smollm2-135m", 24)[1]
    else:
        measure = partial(_loop, y, x, w)
    unit = "ms per decode step" if args.decode else "us per iteration"
    measure()
    alone, beside = [], []
    for _ in range(args.rounds):
        alone.append(measure())
        stop = threading.Event()
        other = threading.Thread(target=_lead_a_team_then_wait, args=(stop, x, w))
        other.start()
        time.sleep(0.2)
        beside.append(measure())
        stop.set()
        other.join()
        time.sleep(0.2)
    print("alone        ", [round(v, 1) for v in alone])
    print("beside a team", [round(v, 1) for v in beside])
    print(
        f"median {unit}: alone {statistics.median(alone):.1f}, "
        f"beside another team {statistics.median(beside):.1f}"
    )


if __name__ == "__main__":
    main()
