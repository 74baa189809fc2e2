"""The requests of one simulated run: the bench's dataset lengths and arrival times."""

from __future__ import annotations

from collections.abc import Sequence

from bulletserve.bench.arrivals import arrival_times, trace_arrival_times
from bulletserve.bench.shared import SHARED_PREFIX_KINDS, shared_prompts
from bulletserve.sim.request import SimRequest

Lengths = Sequence[tuple[int, int, float | None]]  # (input, output, trace timestamp)


def arrivals_for(
    lengths: Lengths, rate: float, burstiness: float, seed: int, trace: bool
) -> list[float]:
    """Arrival offsets exactly as `bullet bench` draws them for this rate and seed."""
    if trace:
        stamps = [t for _, _, t in lengths]
        if any(t is None for t in stamps):
            raise ValueError("--trace-arrivals: the dataset has no timestamps")
        return trace_arrival_times([t for t in stamps if t is not None], rate)
    return arrival_times(len(lengths), rate, burstiness, seed)


def make_requests(
    lengths: Lengths,
    arrivals: Sequence[float],
    prompt_token_ids: Sequence[tuple[int, ...]] | None = None,
) -> list[SimRequest]:
    """Simulated requests; with `prompt_token_ids` (a workload whose prompts share prefixes),
    each carries its prompt's stand-in tokens, so the prefix cache finds what they share."""
    tokens = prompt_token_ids or [None] * len(lengths)
    return [
        SimRequest(f"req-{i}", i, t, input_len, output_len, prompt_token_ids=ids)
        for i, ((input_len, output_len, _), t, ids) in enumerate(
            zip(lengths, arrivals, tokens, strict=True)
        )
    ]


def prompt_tokens(
    spec: str, num_prompts: int, seed: int, max_model_len: int | None
) -> list[tuple[int, ...]] | None:
    """The stand-in prompt tokens of a workload whose prompts share prefixes, else None."""
    if spec not in SHARED_PREFIX_KINDS:
        return None
    return [p.token_ids() for p in shared_prompts(spec, num_prompts, seed, max_model_len)]
