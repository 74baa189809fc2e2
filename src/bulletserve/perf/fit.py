"""Turn measurements into a profile: N_d from a bandwidth sweep, alpha tables from step times.

Pure: no torch, no threads, no I/O.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass

from bulletserve.model.config import ModelConfig
from bulletserve.perf.hardware import Calibration, HardwareProfile, Points, UnitPoint
from bulletserve.perf.inventory import TOKENS, phase_counts
from bulletserve.perf.model import PerfModel
from bulletserve.perf.state import ExecutionState

# N_d: the fewest units that reach this fraction of the best measured bandwidth.
SATURATION_FRACTION = 0.9


@dataclass(frozen=True)
class StepSample:
    """One measured step time of `phase` in `es` (corun: the other lane ran at the same time)."""

    es: ExecutionState
    phase: str
    corun: bool
    measured_s: float

    @property
    def units(self) -> int:
        return self.es.prefill_units if self.phase == "prefill" else self.es.decode_units

    @property
    def rows(self) -> float:
        return phase_counts(self.es, self.phase)[TOKENS]


def saturation_units(sweep: list[UnitPoint]) -> int:
    best = max(p.bandwidth for p in sweep)
    return min(p.units for p in sweep if p.bandwidth >= SATURATION_FRACTION * best)


def fit_alpha(
    cfg: ModelConfig, hw: HardwareProfile, dtype: str, samples: list[StepSample]
) -> dict[str, dict[int, Points]]:
    """alpha = (measured - overhead) / T' per sample, averaged over samples that share
    (phase, co-running, units, rows): alpha[phase or phase_corun][units] = (rows, alpha).
    Decode samples also go, unaveraged over contexts, into `decode@<context>` tables."""
    model = PerfModel(cfg, hw, dtype)
    groups: dict[tuple[str, int, float], list[float]] = defaultdict(list)
    for s in samples:
        t = model.roofline(s.es, s.phase, s.corun)
        alpha = max(s.measured_s - hw.step_overhead_s, 0.0) / t
        key = f"{s.phase}_corun" if s.corun else s.phase
        groups[(key, s.units, s.rows)].append(alpha)
        if s.phase == "decode":
            context = round(statistics.fmean(s.es.decode_ctx))
            groups[(f"{key}@{context}", s.units, s.rows)].append(alpha)
    table: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for (key, units, rows), alphas in sorted(groups.items()):
        table[key][units].append((rows, statistics.fmean(alphas)))
    return {k: {u: tuple(pts) for u, pts in v.items()} for k, v in table.items()}


def calibrate(
    cfg: ModelConfig,
    hw: HardwareProfile,
    dtype: str,
    samples: list[StepSample],
    decode_bandwidth_corun: Points,
) -> HardwareProfile:
    """`hw` with alpha fitted to `samples` and the contention-adjusted decode bandwidth."""
    base = dataclasses.replace(
        hw, calibration=Calibration(decode_bandwidth_corun=decode_bandwidth_corun)
    )
    alpha = fit_alpha(cfg, base, dtype, samples)
    cal = dataclasses.replace(base.calibration, alpha=alpha, unit_sweep=hw.calibration.unit_sweep)
    return dataclasses.replace(hw, calibration=cal)
