"""Compute partitioners: how a lane is confined to its share of the device's units.

CpuThreads (intra-op threads per lane thread), GreenContextSMs (disjoint SM groups through
CUDA green contexts, one stream per lane per split) and WholeGPU (no partitioning). Each has
`lane(units, rest=False)`: a context in which the calling thread runs on `units` units, or on
the units left beside them (`rest`), and `run(units, step, rest=False)`, which runs a lane's
step there (on a CPU with a TeamThread, every multi-threaded step on that one thread).
"""

from __future__ import annotations

import logging

import torch

from bulletserve.partition.cpu import CpuThreads, TeamThread, usable_cores
from bulletserve.partition.cuda import GreenContextSMs, WholeGPU
from bulletserve.partition.errors import UnitsUnavailableError

Units = CpuThreads | GreenContextSMs | WholeGPU

__all__ = [
    "CpuThreads",
    "GreenContextSMs",
    "TeamThread",
    "Units",
    "UnitsUnavailableError",
    "WholeGPU",
    "unit_provider",
    "usable_cores",
]

logger = logging.getLogger(__name__)


def unit_provider(
    device: torch.device, num_threads: int | None = None, team: TeamThread | None = None
) -> CpuThreads | GreenContextSMs:
    """The partitioner for `device`; raises UnitsUnavailableError where it cannot split.
    `team`: on a CPU, the thread that runs multi-threaded lane steps."""
    return GreenContextSMs(device) if device.type == "cuda" else CpuThreads(num_threads, team)


def lane_units(
    device: torch.device, num_threads: int | None = None, team: TeamThread | None = None
) -> Units:
    """Like unit_provider, but on a GPU without green contexts say so and share the device."""
    try:
        return unit_provider(device, num_threads, team)
    except UnitsUnavailableError as exc:
        logger.warning("%s; falling back to --partition none (both lanes on every SM)", exc)
        return WholeGPU(device)
