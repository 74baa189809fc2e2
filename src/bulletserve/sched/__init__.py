"""Scheduling policies: pure functions of a snapshot, returning a plan."""

from __future__ import annotations

from bulletserve.sched.base import Policy
from bulletserve.sched.chunked import ChunkedPolicy
from bulletserve.sched.prefill_first import PrefillFirstPolicy

POLICIES = ("chunked", "prefill-first", "bullet")


def make_policy(name: str, chunk_size: int) -> Policy:
    if name == "chunked":
        return ChunkedPolicy(chunk_size)
    if name == "prefill-first":
        return PrefillFirstPolicy()
    if name == "bullet":
        raise ValueError("the bullet policy runs two lanes: build it with the laned engine")
    raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {name!r}")
