"""The decode-step timer shared by scripts/lane_decode_cost.py and scripts/omp_two_teams.py.

An offline batch of 32 prompts of 128 token ids on a dummy-weight model; each call generates
`max_tokens` greedy tokens for all of them and returns the median `ModelRunner.execute` time of
the full-batch decode steps, in milliseconds (the same shapes under every policy).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from bulletserve import LLM, SamplingParams

BATCH = 32


def decode_step_timer(policy: str, model: str, max_tokens: int) -> tuple[LLM, Callable[[], float]]:
    """(the LLM, a function that runs the batch once and returns its median decode step, ms)."""
    llm = LLM(model=model, load_format="dummy", max_model_len=1024, policy=policy)
    prompts = [[(i * 7919 + j * 104729) % 40000 + 5 for j in range(128)] for i in range(BATCH)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    execute = llm.engine.runner.execute
    times: list[float] = []

    def timed(works):
        start = time.perf_counter()
        result = execute(works)
        if len(works) == BATCH and all(len(w.token_ids) == 1 for w in works):
            times.append(time.perf_counter() - start)
        return result

    llm.engine.runner.execute = timed

    def run() -> float:
        times.clear()
        llm.generate(prompts, params)
        return statistics.median(times) * 1e3

    return llm, run


def print_medians(results: dict[str, list[float]], over: str, under: str) -> float:
    """Each label's median and runs (ms), then the ratio of `over`'s median to `under`'s."""
    for label, values in results.items():
        print(f"{label}: median {statistics.median(values):.1f} ms  runs {values}")
    ratio = statistics.median(results[over]) / statistics.median(results[under])
    print(f"{over} / {under}: {ratio:.2f}", end="")
    return ratio
