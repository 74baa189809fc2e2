"""What a thread that runs a little Python every few milliseconds costs a 2-thread decode step
in the same process (a lane polling its plan while the other lane computes).

The decode-step timer of scripts/decode_timing.py (prefill-first, dummy SmolLM2-135M, 32
sequences) runs alternately alone and beside a thread that busy-loops `--work-ms` of Python
every `--period-ms`; medians of `--rounds` pairs.

    .venv/bin/python scripts/poll_cost.py --rounds 4 --work-ms 0.5 --period-ms 5
"""

from __future__ import annotations

import argparse
import threading
import time

from decode_timing import decode_step_timer, print_medians


def python_beside(stop: threading.Event, work_s: float, period_s: float) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < work_s:
            sum(range(100))
        time.sleep(period_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work-ms", type=float, default=0.5)
    parser.add_argument("--period-ms", type=float, default=5.0)
    parser.add_argument("--model", default="smollm2-135m", help="a dummy preset")
    args = parser.parse_args()
    _, run = decode_step_timer("prefill-first", args.model, 24)
    results: dict[str, list[float]] = {"alone": [], "beside python": []}
    for _ in range(args.rounds):
        results["alone"].append(run())
        stop = threading.Event()
        thread = threading.Thread(
            target=python_beside, args=(stop, args.work_ms / 1e3, args.period_ms / 1e3)
        )
        thread.start()
        results["beside python"].append(run())
        stop.set()
        thread.join()
    print_medians(results, "beside python", "alone")
    print()


if __name__ == "__main__":
    main()
