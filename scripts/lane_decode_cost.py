"""A decode step's model time in bullet's decode lane against the single-lane engine's.

The same offline batch (32 prompts of 128 token ids, 64 greedy tokens each) runs under
prefill-first and under bullet, alternately, --rounds times; each run reports the median
`ModelRunner.execute` time of its full-batch decode steps (the same shapes in both engines).

    .venv/bin/python scripts/lane_decode_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CHILD = """
import statistics, sys, time
from bulletserve import LLM, SamplingParams
policy, model = sys.argv[1], sys.argv[2]
prompts = [[(i * 7919 + j * 104729) % 40000 + 5 for j in range(128)] for i in range(32)]
llm = LLM(model=model, load_format="dummy", max_model_len=1024, policy=policy)
llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
times = []
execute = llm.engine.runner.execute
def timed(works):
    start = time.perf_counter()
    result = execute(works)
    if len(works) == 32 and all(len(w.token_ids) == 1 for w in works):
        times.append(time.perf_counter() - start)
    return result
llm.engine.runner.execute = timed
llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
if hasattr(llm.engine, "close"):
    llm.engine.close()
print(statistics.median(times) * 1e3)
"""


def run(policy: str, model: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, policy, model], capture_output=True, text=True, check=True
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
    for policy, values in results.items():
        print(f"{policy}: median {statistics.median(values):.1f} ms  runs {values}")
    ratio = statistics.median(results["bullet"]) / statistics.median(results["prefill-first"])
    print(f"bullet / prefill-first: {ratio:.2f} ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
