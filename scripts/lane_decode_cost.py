"""A decode step's model time in bullet's decode lane against the single-lane engine's.

The same offline batch (32 prompts of 128 token ids, 64 greedy tokens each) runs under
prefill-first and under bullet, alternately, --rounds times; each run reports the median
`ModelRunner.execute` time of its full-batch decode steps (the same shapes in both engines).

    .venv/bin/python scripts/lane_decode_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from decode_timing import print_medians

# Run in a fresh process per measurement, with this folder on its path.
CHILD = """
import sys
sys.path.insert(0, sys.argv[3])
from decode_timing import decode_step_timer
llm, run = decode_step_timer(sys.argv[1], sys.argv[2], 64)
print(run())
close = getattr(llm.engine, "close", None)
if close is not None:
    close()
"""


def run(policy: str, model: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, policy, model, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m", help="a dummy preset")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"prefill-first": [], "bullet": []}
    started = time.time()
    for _ in range(args.rounds):
        for policy in results:
            results[policy].append(run(policy, args.model))
    print_medians(results, "bullet", "prefill-first")
    print(f" ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
