"""Bullet's tunables and the device traits its rules read. Why each value is what it is:
docs/bullet-rules.md."""

from __future__ import annotations

from dataclasses import dataclass

from bulletserve.perf.hardware import HardwareProfile


@dataclass(frozen=True)
class BulletParams:
    # A waiting prompt is at risk when the time it has waited plus its predicted prefill
    # reaches this share of its TTFT budget: it then goes first and is never passed over.
    risk_share: float = 0.7
    # Decode gets units for a predicted step within this share of the TPOT SLO, and a fused
    # step fits within it.
    tpot_headroom: float = 0.8
    # While TTFT misses and P90 TPOT holds, a fused step may take up to this multiple of the
    # TPOT SLO (rule `fused-ttft-first`).
    late_fused_step_limit: float = 1.5
    # A prompt too long for a fused step within its limit rides in chunks of a multiple of
    # this many tokens (its last chunk: what is left).
    chunk_granule: int = 64
    # Recent requests behind the P90 TTFT and TPOT the rules read.
    stats_window: int = 64
    # A prefill batch grows until a prompt token costs more than this share of the cheapest
    # per-token cost of a smaller batch (the device is saturated past it).
    saturation_ratio: float = 0.9
    # Beyond this median relative error of its recent predictions the performance model is
    # not trusted: the policy runs chunked prefill's plan until it has caught up (rule
    # `chunked-plan`).
    model_error_bound: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.risk_share <= 1 or not 0 < self.tpot_headroom <= 1:
            raise ValueError("risk_share and tpot_headroom must be in (0, 1]")
        if self.late_fused_step_limit < self.tpot_headroom:
            raise ValueError("late_fused_step_limit must be at least tpot_headroom")
        if self.chunk_granule < 1 or self.stats_window < 1:
            raise ValueError("chunk_granule and stats_window must be at least 1")
        if not 0 < self.saturation_ratio < 1:
            raise ValueError("saturation_ratio must be in (0, 1)")
        if self.model_error_bound <= 0:
            raise ValueError("model_error_bound must be positive")


@dataclass(frozen=True)
class DeviceTraits:
    """What differs between devices, as the rules see it.

    `takes_turns`: where running the lanes side by side does less work a second than running
    them one after the other on every unit, the lanes take turns, prefill first (rule `turns`);
    and since decode then waits out each prefill anyway, a fused step may carry the whole batch
    even where no part of it fits the TPOT budget. True on CPUs: a lane there has a thread or
    two, and splitting them is often zero-sum or worse. False on GPUs, where a small decode
    lane beside a prefill keeps decode stepping and the co-running rules size it."""

    takes_turns: bool

    @classmethod
    def of(cls, hw: HardwareProfile) -> DeviceTraits:
        return cls(takes_turns=hw.kind == "cpu")
