"""The performance model an executor plans with: the model's shape on the device's profile,
given (`--hardware-profile`) or measured at start. Bullet's lanes split the device by it; one
lane under speculative decoding prices its drafts by it (`sched.drafts`)."""

from __future__ import annotations

import logging

import torch

from bulletserve.engine.parts import EngineParts
from bulletserve.partition import Units
from bulletserve.partition.measure import DTYPE_NAMES, QUICK, measure_device
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.model import PerfModel

logger = logging.getLogger(__name__)

# Profiles measured at start in this process, by (unit kind, units, dtype): the same device
# measured again gives the same answer, so a second engine (a test's, a restart's) reuses it.
_measured: dict[tuple[str, int, torch.dtype], HardwareProfile] = {}


def hardware_profile(path: str | None, units: Units, dtype: torch.dtype) -> HardwareProfile:
    """The profile at `path`, or the device's peak GEMM rate and bandwidth measured now."""
    if path:
        return HardwareProfile.load(path)
    key = (units.kind, units.total, dtype)
    if key not in _measured:
        logger.warning(
            "no --hardware-profile: measuring peak GEMM rate and bandwidth now (a few "
            "seconds); `bullet profile` gives the scheduler calibrated predictions"
        )
        _measured[key] = measure_device(units, QUICK, "measured-at-start", logger.info, dtype)
    return _measured[key]


def perf_model(parts: EngineParts, profile: HardwareProfile) -> PerfModel:
    """The engine's model on `profile`, for one tensor-parallel rank's share of it."""
    ranks = parts.config.tensor_parallel_size
    priced = ranks == 1 or ranks in profile.calibration.all_reduce_s
    if not priced:
        logger.warning(
            "the hardware profile has no all-reduce times for %d ranks: step predictions "
            "leave the collectives to the online correction",
            ranks,
        )
    return PerfModel(
        parts.model.config,
        profile,
        DTYPE_NAMES[parts.dtype],
        tensor_parallel_size=ranks,
        price_collectives=priced,
        weight_bits=parts.model.weight_bits,
    )
