"""A mixed workload's service classes: each a share of the requests, its SLO, and the priority
its requests ask for. `bullet bench` and `bullet simulate` draw the same class for request i
from the same seed, and score every request against its own class's SLO."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bulletserve.sched.slo import SLO, TARGETS_FORMAT, parse_targets


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    share: float
    slo: SLO
    priority: int = 0  # lower runs first (sent only with --send-priority)


def parse_workload_class(text: str) -> WorkloadClass:
    """`NAME:SHARE:TTFT_PER_TOKEN_MS,TPOT_MS[,TTFT_BASE_MS][:PRIORITY]`, e.g.
    `interactive:0.3:2,100:0` or, with a fixed part of the TTFT target,
    `interactive:0.3:2,100,50:0`."""
    parts = text.split(":")
    try:
        if len(parts) not in (3, 4) or not parts[0]:
            raise ValueError("three or four fields")
        share = float(parts[1])
        if not 0 < share <= 1:
            raise ValueError("the share must be in (0, 1]")
        slo = parse_targets(parts[2])
        priority = int(parts[3]) if len(parts) == 4 else 0
    except ValueError as exc:
        raise ValueError(
            f"expected NAME:SHARE:{TARGETS_FORMAT}[:PRIORITY], not {text!r} ({exc})"
        ) from None
    return WorkloadClass(parts[0], share, slo, priority)


def check_classes(classes: list[WorkloadClass]) -> None:
    """ValueError unless the classes have distinct names and shares summing to 1."""
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"class names repeat: {', '.join(names)}")
    total = sum(c.share for c in classes)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"the classes' shares sum to {total:g}, not 1")


def assign_classes(count: int, classes: list[WorkloadClass], seed: int) -> list[WorkloadClass]:
    """Each of `count` requests' class: every class's share of them, rounded by largest
    remainder so the counts are exact, in an order shuffled by `seed`."""
    exact = [c.share * count for c in classes]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(classes)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    drawn = [c for c, n in zip(classes, counts, strict=True) for _ in range(n)]
    random.Random(seed).shuffle(drawn)
    return drawn
