"""Piecewise-linear interpolation for calibration tables (exact on the measured points)."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from bulletserve.perf.hardware import Points


@dataclass(frozen=True)
class Curve:
    """y(x), linear between points (in log x when `log_x`), constant beyond the ends."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    log_x: bool

    @classmethod
    def from_points(cls, points: Points, log_x: bool) -> Curve:
        xs = tuple(math.log(x) if log_x else x for x, _ in points)
        return cls(xs, tuple(y for _, y in points), log_x)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if self.log_x:
            x = math.log(x) if x > 0 else -math.inf
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        j = bisect_right(xs, x)
        x0, x1 = xs[j - 1], xs[j]
        return ys[j - 1] + (ys[j] - ys[j - 1]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class AlphaSurface:
    """alpha(units, rows): a log-rows curve per measured unit count, linear between counts."""

    units: tuple[int, ...]
    curves: tuple[Curve, ...]

    @classmethod
    def from_table(cls, table: dict[int, Points]) -> AlphaSurface:
        units = tuple(sorted(table))
        return cls(units, tuple(Curve.from_points(table[u], log_x=True) for u in units))

    def __call__(self, units: float, rows: float) -> float:
        us = self.units
        if units <= us[0]:
            return self.curves[0](rows)
        if units >= us[-1]:
            return self.curves[-1](rows)
        j = bisect_right(us, units)
        lo, hi = self.curves[j - 1](rows), self.curves[j](rows)
        return lo + (hi - lo) * (units - us[j - 1]) / (us[j] - us[j - 1])
