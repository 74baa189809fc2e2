"""The engine's own time per decode step outside the model runner, offline (no server).

For each batch size, `batch` requests decode together under prefill-first on the default model;
each engine step is timed whole and its `ModelRunner.execute` call alone, and the medians of the
decode steps (after five) are printed: what scheduling, sampling, detokenization and
bookkeeping add to a step.

    .venv/bin/python scripts/engine_host_cost.py --batches 1,8,16,32 [--temperature 1]

`--temperature` 0 (the default) samples greedily; 1 is what a server request without a
temperature gets, and what `bullet bench` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bulletserve import LLM, SamplingParams


def measure(batch: int, output_len: int, temperature: float) -> tuple[float, float]:
    """(median engine step seconds, median runner seconds) of full-batch decode steps."""
    engine = LLM(policy="prefill-first", max_model_len=1024, max_num_seqs=batch).engine
    runner_times: list[tuple[int, float]] = []
    execute = engine.runner.execute

    def timed(works):
        start = time.perf_counter()
        result = execute(works)
        runner_times.append((len(works), time.perf_counter() - start))
        return result

    engine.runner.execute = timed
    params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(i * 31 + j * 7) % 40000 + 5 for j in range(64)], params)
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    decode = [(s, r) for s, (n, r) in zip(steps, runner_times, strict=True) if n == batch][5:]
    return statistics.median(s for s, _ in decode), statistics.median(r for _, r in decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,16,32")
    parser.add_argument("--output-len", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    print("| batch | engine step ms | runner ms | outside the runner ms |")
    print("|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        step, runner = measure(batch, args.output_len, args.temperature)
        print(f"| {batch} | {step * 1e3:.2f} | {runner * 1e3:.2f} | {(step - runner) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
