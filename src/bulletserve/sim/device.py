"""The modeled device: step durations from the performance model, with seeded noise, and the
two lanes' steps progressing on it.

The device runs at the performance model's uncorrected predictions (cached by execution state)
times `slowdown`: 1 is a device exactly as the profile believes it, 2 one twice as slow (a
profile that is wrong, or none: the model's error test). Noise is multiplicative and log-normal,
exp(N(0, noise)), drawn once per step from a seeded generator: 0 gives the model's predictions
exactly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bulletserve.bookkeeping.lane_core import LANES, LaneCore, LaneStep
from bulletserve.bookkeeping.record import Lane
from bulletserve.bookkeeping.single_step import SingleStep
from bulletserve.model.config import ModelConfig
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.model import PerfModel, StepPrediction


class CachedPerfModel(PerfModel):
    """A PerfModel whose uncorrected predictions are memoized; the policy and the simulator
    share it (the policy under its online corrections, the device without them)."""

    def __init__(
        self,
        cfg: ModelConfig,
        hw: HardwareProfile,
        dtype: str = "bfloat16",
        tensor_parallel_size: int = 1,
        weight_bits: float | None = None,
    ) -> None:
        super().__init__(
            cfg, hw, dtype, tensor_parallel_size=tensor_parallel_size, weight_bits=weight_bits
        )
        self._cache: dict[ExecutionState, StepPrediction] = {}

    def uncorrected(self, es: ExecutionState) -> StepPrediction:
        hit = self._cache.get(es)
        if hit is None:
            hit = self._cache[es] = super().uncorrected(es)
        return hit

    def device_s(self, es: ExecutionState, slowdown: float) -> StepPrediction:
        """What the modeled device takes for `es` (before noise): the uncorrected prediction
        times `slowdown`."""
        raw = self.uncorrected(es)
        if slowdown == 1.0:
            return raw
        return StepPrediction(raw.prefill_s * slowdown, raw.decode_s * slowdown)


class Noise:
    """Seeded multiplicative step-time noise."""

    def __init__(self, sigma: float, seed: int) -> None:
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise ValueError(f"--noise must be >= 0, not {sigma}")
        self.sigma = sigma
        self._rng = random.Random(seed)

    def factor(self) -> float:
        return self._rng.lognormvariate(0.0, self.sigma) if self.sigma else 1.0


@dataclass(frozen=True)
class SingleTiming:
    """A single-lane step on the modeled device: its batch as the performance model takes it,
    the prediction for it on every unit, that times noise, and the engine's host time after it
    for the rows it samples (its tokens reach their streams after that)."""

    state: ExecutionState
    predicted_s: float
    measured_s: float
    host_s: float


def time_single_step(
    perf: CachedPerfModel, noise: Noise, step: SingleStep, units: int, slowdown: float = 1.0
) -> SingleTiming:
    """The modeled time of a step about to run (before `end_single_step`)."""
    es, phase = step.execution_state(units)
    prediction = perf.device_s(es, slowdown)
    predicted = prediction.prefill_s if phase == "prefill" else prediction.decode_s
    # A verified row (speculative decoding) reaches past its tokens: it samples too.
    sampled = sum(r.num_computed_tokens + n >= r.num_tokens for r, n in step.batch)
    return SingleTiming(es, predicted, predicted * noise.factor(), perf.host_s(sampled))


def step_elapsed_s(device_s: float, host_s: float, host_overlap: bool) -> float:
    """A step's time on the clock: the device's, then the engine's host time around it; with
    `host_overlap` (a what-if: the host plans and prepares the next step, and hands this one's
    tokens on, while the device runs) the longer of the two, the steady state of such a
    pipeline."""
    return max(device_s, host_s) if host_overlap else device_s + host_s


@dataclass
class Timing:
    """A step's progress on the modeled device: `work_left` is the share still to run at time
    `since`; it runs at 1/duration per second, duration being the prediction for what runs now
    times the step's noise, plus the engine's host time, which contention does not stretch."""

    noise: float
    started: float
    host_s: float
    work_left: float = 1.0
    since: float = 0.0
    duration: float = 0.0
    busy_s: float = 0.0  # noise-free time run so far, for the step log's predicted_s

    @property
    def end(self) -> float:
        return self.since + self.work_left * self.duration


class ModeledLanes:
    """The two lanes' steps in flight on the modeled device: each progresses at the rate the
    performance model predicts for what runs on the device now (`LaneCore.execution_state`),
    re-evaluated whenever a lane starts or ends a step, so co-running contention applies
    exactly while both lanes run. The simulator and a virtual clock under the real engine time
    lane steps with it."""

    def __init__(
        self,
        core: LaneCore,
        perf: CachedPerfModel,
        noise: Noise,
        slowdown: float = 1.0,
        host_overlap: bool = False,
    ) -> None:
        self.core, self.perf, self.noise, self.slowdown = core, perf, noise, slowdown
        self.host_overlap = host_overlap
        self.timing: dict[Lane, Timing | None] = dict.fromkeys(LANES)

    def start(self, step: LaneStep, now: float) -> None:
        """A step the core has just started."""
        timing = Timing(self.noise.factor(), now, self.perf.host_s(self._sampled_rows(step)))
        timing.since = now
        self.timing[step.lane] = timing
        self.rerate(now)

    def end(self, lane: Lane, now: float) -> Timing:
        """The lane's step ends now: its progress folded in; the caller ends it in the core,
        then calls `rerate` for the lane left running."""
        self.rerate(now)
        timing = self.timing[lane]
        assert timing is not None
        self.timing[lane] = None
        return timing

    def next_end(self) -> tuple[float, Lane] | None:
        """The earliest step end, prefill first on a tie."""
        ends = [(t.end, lane) for lane, t in self.timing.items() if t is not None]
        return min(ends, key=lambda e: (e[0], LANES.index(e[1]))) if ends else None

    def rerate(self, now: float) -> None:
        """Fold the time run so far into each step's progress, then set its rate for what runs
        from now on."""
        prediction = self.perf.device_s(self.core.execution_state(), self.slowdown)
        for lane, timing in self.timing.items():
            if timing is None:
                continue
            if timing.duration > 0:
                ran = now - timing.since
                timing.work_left = max(0.0, timing.work_left - ran / timing.duration)
                timing.busy_s += ran / timing.noise
            timing.since = now
            predicted = prediction.prefill_s if lane == "prefill" else prediction.decode_s
            timing.duration = step_elapsed_s(
                predicted * timing.noise, timing.host_s, self.host_overlap
            )

    def _sampled_rows(self, step: LaneStep) -> int:
        """Rows the step samples, for the engine's host time around it."""
        if step.lane == "decode":
            return len(step.requests)
        if step.layers[1] != self.core.num_layers:
            return 0
        completes = all(
            c + n == r.num_tokens
            for r, c, n in zip(step.requests, step.cached, step.lengths, strict=True)
        )
        return (len(step.requests) if completes else 0) + len(step.fused)
