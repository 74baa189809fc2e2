"""The modeled device: step durations from the performance model, with seeded noise.

Predictions are cached by execution state (the simulator never calls `observe`, so a state's
prediction never changes). Noise is multiplicative and log-normal, exp(N(0, noise)), drawn once
per step from a seeded generator: 0 gives the model's predictions exactly.
"""

from __future__ import annotations

import math
import random

from bulletserve.model.config import ModelConfig
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.model import Corrections, PerfModel, StepPrediction
from bulletserve.perf.state import ExecutionState


class CachedPerfModel(PerfModel):
    """A PerfModel whose predictions are memoized; the policy and the simulator share it."""

    def __init__(self, cfg: ModelConfig, hw: HardwareProfile, dtype: str = "bfloat16") -> None:
        super().__init__(cfg, hw, dtype)
        self._cache: dict[ExecutionState, StepPrediction] = {}

    def predict(self, es: ExecutionState, corrections: Corrections | None = None) -> StepPrediction:
        if corrections is not None and corrections != self.corrections:
            return super().predict(es, corrections)
        hit = self._cache.get(es)
        if hit is None:
            hit = self._cache[es] = super().predict(es)
        return hit

    def observe(self, es: ExecutionState, phase: str, measured_s: float) -> None:
        raise RuntimeError("the simulated device has no measurements to fold in")


class Noise:
    """Seeded multiplicative step-time noise."""

    def __init__(self, sigma: float, seed: int) -> None:
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise ValueError(f"--noise must be >= 0, not {sigma}")
        self.sigma = sigma
        self._rng = random.Random(seed)

    def factor(self) -> float:
        return self._rng.lognormvariate(0.0, self.sigma) if self.sigma else 1.0
