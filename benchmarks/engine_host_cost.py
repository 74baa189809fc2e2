"""The engine's own time per decode step outside the model runner, offline (no server).

For each batch size, `batch` requests decode together under prefill-first on the model
(default: the embedded one; `--model tiny --load-format dummy`, a model so small that its step
is nearly all host);
each engine step is timed whole and its `ModelRunner.execute` call alone, and the medians of the
decode steps (after five) are printed: what scheduling, sampling, detokenization and
bookkeeping add to a step.

    .venv/bin/python benchmarks/engine_host_cost.py --batches 1,8,16,32 [--temperature 1]
    .venv/bin/python benchmarks/engine_host_cost.py --model tiny --load-format dummy \
        --batches 1,16,64,256

`--temperature` 0 (the default) samples greedily; 1 is what a server request without a
temperature gets, and what `bullet bench` runs. `--constraints json` holds every row to a JSON
schema (a string of at least 400 characters, so that no row's structure ends within the run),
`--constraints penalties` gives every row presence, frequency and repetition penalties and a
logit bias: the per-step cost of what requests ask of their logits. `--breakdown` also profiles
the decode steps of the largest batch (cProfile) and prints where an engine step's time goes.
`--async-scheduling` runs the engine so (a step then reads back the one before it).

Cited in docs/benchmarks.md "Host cost per step", "Host ceiling" and "What requests ask of their
logits"; docs/commands/simulate.md.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from bulletserve import LLM, SamplingParams
from bulletserve.engine.structured import StructuredOutputs

LONG_STRING = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 400}},
    "required": ["text"],
}
CONSTRAINTS = {
    "none": {},
    "json": {"structured_outputs": StructuredOutputs.json_schema(LONG_STRING)},
    "penalties": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {100: 1.0, 200: -1.0},
    },
}

# The parts of an engine step, as (file suffix, function name) of the call that holds each.
PARTS = {
    "take in requests": ("engine/life.py", "take_in"),
    "snapshot for the policy": ("engine/single_lane.py", "snapshot"),
    "plan (policy)": ("sched/prefill_first.py", "plan"),
    "book: preempt, admit, KV blocks": ("bookkeeping/single_step.py", "begin_single_step"),
    "runner: inputs to tensors": ("engine/model_runner.py", "prepare"),
    "runner: embed + layers": ("model/decoder.py", "run_layers"),
    "runner: LM head": ("engine/model_runner.py", "logits"),
    "book: end of step": ("bookkeeping/single_step.py", "end_single_step"),
    "sampler: draw": ("engine/sampler.py", "draw"),
    "sampler: read back": ("engine/sampler.py", "read"),
    "tokens: detokenize, stops": ("engine/life.py", "append_token"),
    "outputs": ("engine/life.py", "output"),
}


def measure(
    batch: int,
    output_len: int,
    temperature: float,
    model: str | None,
    load_format: str,
    profile: cProfile.Profile | None = None,
    constraint: str = "none",
    async_scheduling: bool = False,
) -> tuple[float, float]:
    """(median engine step seconds, median runner seconds) of full-batch decode steps; with
    `profile`, the decode steps after the first five run under it."""
    engine = LLM(
        model=model,
        load_format=load_format,
        policy="prefill-first",
        max_model_len=1024,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, 64 * batch),
        async_scheduling=async_scheduling,
    ).engine
    vocab = engine.model_config.vocab_size
    runner_times: list[tuple[int, float]] = []
    execute = engine.runner.execute

    def timed(works, out=None, **kwargs):
        start = time.perf_counter()
        result = execute(works, out, **kwargs)
        runner_times.append((len(works), time.perf_counter() - start))
        return result

    engine.runner.execute = timed
    params = SamplingParams(
        max_tokens=output_len, temperature=temperature, ignore_eos=True, **CONSTRAINTS[constraint]
    )
    for i in range(batch):
        engine.add_request([(i * 31 + j * 7) % (vocab - 5) + 5 for j in range(64)], params)
    decode = []  # (step seconds, runner seconds) of the steps that ran the whole batch
    while engine.has_unfinished():
        profiling = profile is not None and len(decode) > 10  # decode steps, past the first
        if profiling:
            profile.enable()
        calls = len(runner_times)
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if profiling:
            profile.disable()
        if len(runner_times) == calls + 1 and runner_times[-1][0] == batch:
            decode.append((seconds, runner_times[-1][1]))
    decode = decode[5:]
    return statistics.median(s for s, _ in decode), statistics.median(r for _, r in decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,16,32")
    parser.add_argument("--output-len", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--breakdown", action="store_true", help="profile the largest batch")
    parser.add_argument(
        "--constraints",
        default="none",
        help=f"comma-separated, of {', '.join(CONSTRAINTS)}: each batch size is run under each",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the engine's --async-scheduling: each step planned and launched before the last "
        "one's tokens are read back (on a CPU, the same work in another order)",
    )
    args = parser.parse_args()
    constraints = args.constraints.split(",")
    unknown = set(constraints) - set(CONSTRAINTS)
    if unknown:
        parser.error(f"--constraints: unknown {', '.join(sorted(unknown))}")
    print("| batch | constraint | engine step ms | runner ms | outside the runner ms |")
    print("|---|---|---|---|---|")
    batches = [int(b) for b in args.batches.split(",")]
    profile = cProfile.Profile() if args.breakdown else None
    for batch in batches:
        for constraint in constraints:
            step, runner = measure(
                batch,
                args.output_len,
                args.temperature,
                args.model,
                args.load_format,
                profile if batch == max(batches) and constraint == constraints[-1] else None,
                constraint,
                args.async_scheduling,
            )
            times = f"{step * 1e3:.2f} | {runner * 1e3:.2f} | {(step - runner) * 1e3:.2f}"
            print(f"| {batch} | {constraint} | {times} |")
    if profile is not None:
        print_breakdown(profile, max(batches))


def print_breakdown(profile: cProfile.Profile, batch: int) -> None:
    """Cumulative time per part of the profiled decode steps, as a share of the whole."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = sum(tt for _, _, tt, _, _ in stats.values())
    print(f"\nWhere a decode step of {batch} rows goes (cProfile, cumulative):\n")
    print("| part | share of the step |")
    print("|---|---:|")
    for part, (suffix, name) in PARTS.items():
        found = [
            ct for (file, _, fn), (_, _, _, ct, _) in stats.items()
            if fn == name and file.endswith(suffix)
        ]  # fmt: skip
        if not found:  # the engine's code moved: a share of 0% would be a wrong answer
            raise SystemExit(f"--breakdown: {suffix}:{name} ({part}) was not called in a step")
        print(f"| {part} | {100 * sum(found) / total:.1f}% |")


if __name__ == "__main__":
    main()
