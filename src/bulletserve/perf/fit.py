"""Turn measurements into a profile: N_d from a bandwidth sweep, alpha tables from step times.

Pure: no torch, no threads, no I/O.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from bulletserve.model.config import ModelConfig
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.hardware import Calibration, HardwareProfile, Points, UnitPoint
from bulletserve.perf.inventory import TOKENS, phase_counts
from bulletserve.perf.model import PerfModel

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

    @property
    def other_rows(self) -> float:
        """The other lane's rows: its load while this phase ran."""
        return phase_counts(self.es, "decode" if self.phase == "prefill" else "prefill")[TOKENS]


def saturation_units(sweep: list[UnitPoint]) -> int:
    best = max(p.bandwidth for p in sweep)
    return min(p.units for p in sweep if p.bandwidth >= SATURATION_FRACTION * best)


def corun_references(samples: list[StepSample]) -> dict[str, tuple[float, float]]:
    """Per phase, the (own rows, other lane's rows) its co-running samples share most often.

    The profile measures co-running as a cross: own rows varied at one load of the other lane,
    and that load varied at one own size. The co-running alpha table is fitted along the first
    arm, the load factor along the second."""
    refs = {}
    for phase in ("prefill", "decode"):
        corun = [s for s in samples if s.corun and s.phase == phase]
        if corun:
            own = Counter(s.rows for s in corun).most_common(1)[0][0]
            other = Counter(s.other_rows for s in corun).most_common(1)[0][0]
            refs[phase] = (own, other)
    return refs


def fit_alpha(
    cfg: ModelConfig, hw: HardwareProfile, dtype: str, samples: list[StepSample]
) -> tuple[dict[str, dict[int, Points]], dict[str, dict[int, Points]]]:
    """(alpha tables, co-running load tables) from measured steps.

    alpha = (measured - overhead) / T' per sample, averaged over samples that share
    (phase, co-running, units, rows): alpha[phase or phase_corun][units] = (rows, alpha).
    Decode samples also go, unaveraged over contexts, into `decode@<context>` tables. Co-running
    samples at the reference load of the other lane make the `_corun` tables; those at the
    reference own rows give load[phase][units] = (other rows, alpha / alpha at the reference)."""
    model = PerfModel(cfg, hw, dtype)
    refs = corun_references(samples)
    groups: dict[tuple[str, int, float], list[float]] = defaultdict(list)
    loads: dict[tuple[str, int, float], list[float]] = defaultdict(list)
    for s in samples:
        t = model.roofline(s.es, s.phase, s.corun)
        alpha = max(s.measured_s - hw.step_overhead_s, 0.0) / t
        key = f"{s.phase}_corun" if s.corun else s.phase
        if s.corun:
            ref_own, ref_other = refs[s.phase]
            if s.rows == ref_own:
                loads[(s.phase, s.units, s.other_rows)].append(alpha)
            if s.other_rows != ref_other:
                continue
        groups[(key, s.units, s.rows)].append(alpha)
        if s.phase == "decode":
            context = round(statistics.fmean(s.es.decode_ctx))
            groups[(f"{key}@{context}", s.units, s.rows)].append(alpha)
    table: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for (key, units, rows), alphas in sorted(groups.items()):
        table[key][units].append((rows, statistics.fmean(alphas)))
    load_table: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for (phase, units, other), alphas in sorted(loads.items()):
        reference = loads.get((phase, units, refs[phase][1]))
        if not reference:
            continue
        load_table[phase][units].append(
            (other, statistics.fmean(alphas) / statistics.fmean(reference))
        )
    return _frozen(table), _frozen(load_table)


def _frozen(table: dict[str, dict[int, list[tuple[float, float]]]]) -> dict[str, dict[int, Points]]:
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
    alpha, corun_load = fit_alpha(cfg, base, dtype, samples)
    cal = dataclasses.replace(
        base.calibration,
        alpha=alpha,
        corun_load=corun_load,
        unit_sweep=hw.calibration.unit_sweep,
    )
    return dataclasses.replace(hw, calibration=cal)
