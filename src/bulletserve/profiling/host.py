"""The engine's time per step outside the model runner (sampling, scheduling, block bookkeeping,
detokenizing, building outputs), which the step sweeps do not see: the sampler's cost per logit
alone, and the whole of it measured on a real engine decoding batches of requests to the end."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from bulletserve.engine.engine import LLMEngine
from bulletserve.engine.request import Request, RequestTimings
from bulletserve.engine.sampler import Sampler
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.partition import CpuThreads, GreenContextSMs
from bulletserve.partition.measure import settle, time_call

PROMPT_TOKENS = 64
SKIPPED_STEPS = 3  # the first decode steps of a batch warm caches up


def outside_runner_s(
    engine: LLMEngine, batches: Sequence[int], output_tokens: int, sync: Callable[[], None]
) -> list[tuple[int, float]]:
    """(rows, median seconds) per batch size: each batch decodes `output_tokens` tokens (at
    temperature 1, what a request that sets none gets) and every full decode step is timed
    whole and its model runner call alone (followed by `sync`, so that device work is not
    counted as the host's)."""
    if output_tokens <= SKIPPED_STEPS + 1:
        raise ValueError(f"the host cost needs over {SKIPPED_STEPS + 1} output tokens")
    calls: list[tuple[bool, float]] = []  # (decode rows only, seconds) per runner call
    runner = engine.runner
    execute = runner.execute

    def timed(works: list, out: object = None, **kwargs: object) -> object:
        start = time.perf_counter()
        result = execute(works, out, **kwargs)
        sync()
        calls.append((all(len(w.token_ids) == 1 for w in works), time.perf_counter() - start))
        return result

    runner.execute = timed
    vocab = engine.model_config.vocab_size
    points = []
    try:
        params = SamplingParams(max_tokens=output_tokens, temperature=1.0, ignore_eos=True)
        for rows in batches:
            for i in range(rows):
                prompt = [(i * 31 + j * 7) % (vocab - 5) + 5 for j in range(PROMPT_TOKENS)]
                engine.add_request(prompt, params)
            outside = []
            # The prefill steps, the decode steps, a spare.
            for _ in range(output_tokens + rows * PROMPT_TOKENS // 16 + 2):
                if not engine.has_unfinished():
                    break
                calls.clear()
                start = time.perf_counter()
                engine.step()
                step_s = time.perf_counter() - start
                if len(calls) == 1 and calls[0][0] and len(engine.running) == rows:
                    outside.append(max(step_s - calls[0][1], 0.0))
            if engine.has_unfinished():
                raise RuntimeError(f"the host-cost batch of {rows} did not finish")
            if len(outside) <= SKIPPED_STEPS:
                raise RuntimeError(f"the host-cost batch of {rows} ran too few full decode steps")
            points.append((rows, statistics.median(outside[SKIPPED_STEPS:])))
    finally:
        del runner.execute  # back to the class's method
    return points


def sampling_cost(
    units: CpuThreads | GreenContextSMs, vocab: int, rows: int, count: int, repeats: int
) -> float:
    """Seconds per logit (row x vocabulary entry) of the engine's sampler on `count` units, at
    temperature 1 (what a request that sets none gets), over `rows` rows of float32 logits: the
    median call, since the engine pays the typical call at every step."""
    logits = torch.randn(rows, vocab, device=units.device)
    requests = [
        Request(f"sample-{i}", None, [0], SamplingParams(temperature=1.0), RequestTimings(0.0))
        for i in range(rows)
    ]
    sampler = Sampler(0)
    stop_ids = [frozenset()] * rows
    settle(units.device)
    with units.lane(count):
        seconds = time_call(
            lambda: sampler.sample(logits, requests, stop_ids),
            units.synchronize,
            repeats,
            statistics.median,
        )
    return seconds / (rows * vocab)
