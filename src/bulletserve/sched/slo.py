"""The latency targets a request is held to, in the one form every part uses."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The tightest target a request may be held to: 1 microsecond, in ms. Below it a target is no
# latency any device reaches, and a target that underflows to 0 s would divide the latency
# window's ratios by zero.
MIN_TARGET_MS = 1e-3
# The loosest: about 11.6 days, in ms; past it a target's arithmetic stops being exact.
MAX_TARGET_MS = 1e9


@dataclass(frozen=True)
class SLO:
    """Bullet's SLOs: TTFT per input token (ms), plus an optional fixed part, and TPOT (ms).

    A request of n input tokens meets its TTFT SLO when TTFT <= ttft_base_ms + n *
    ttft_per_token_ms. The paper's SLO is per token alone (base 0); a base lets the SLO stay a
    fixed multiple of the isolated latency, which has a fixed part, for very short prompts."""

    ttft_per_token_ms: float
    tpot_ms: float
    ttft_base_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_per_token_ms", "tpot_ms", "ttft_base_ms"):
            check_target(name, getattr(self, name))

    def ttft_limit_ms(self, input_len: int) -> float:
        return self.ttft_base_ms + self.ttft_per_token_ms * max(input_len, 1)

    def ttft_s(self, input_len: int) -> float:
        return self.ttft_limit_ms(input_len) / 1e3

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1e3


def check_target(name: str, value: float, label: str | None = None) -> None:
    """ValueError, naming `label` (default: `name`), where target `name` is out of its range:
    [MIN_TARGET_MS, MAX_TARGET_MS] ms, the fixed part (`ttft_base_ms`) from 0."""
    low = 0.0 if name == "ttft_base_ms" else MIN_TARGET_MS
    if not (math.isfinite(value) and low <= value <= MAX_TARGET_MS):
        raise ValueError(
            f"{label or name} must be in [{low:g}, {MAX_TARGET_MS:g}] ms, got {value!r}"
        )


@dataclass(frozen=True)
class ServiceClass:
    """What one request is held to: its priority (lower runs first, vLLM's `priority`) and its
    SLO, with its class's name for metrics and reports (a `--slo-class` of the server's;
    "default": the server's own SLO; "custom": targets the request gave itself)."""

    priority: int = 0
    slo: SLO | None = None  # None: the server's
    name: str = "default"


TARGETS_FORMAT = "TTFT_PER_TOKEN_MS,TPOT_MS[,TTFT_BASE_MS]"


def parse_targets(text: str) -> SLO:
    """`TTFT_PER_TOKEN_MS,TPOT_MS[,TTFT_BASE_MS]` -> that SLO; a ValueError saying what is
    wrong (the callers name their flag's whole format)."""
    try:
        numbers = [float(x) for x in text.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3):
        raise ValueError("two or three numbers")
    return SLO(*numbers)


def parse_slo_class(text: str) -> tuple[str, SLO]:
    """`NAME=TTFT_PER_TOKEN_MS,TPOT_MS[,TTFT_BASE_MS]` -> (name, its SLO); ValueError saying
    what is wrong."""
    name, _, targets = text.partition("=")
    try:
        if not name:
            raise ValueError("a name")
        slo = parse_targets(targets)
    except ValueError as exc:
        raise ValueError(f"expected NAME={TARGETS_FORMAT}, not {text!r} ({exc})") from None
    if name in ("default", "custom"):
        raise ValueError(
            f"{text!r}: {name!r} is taken (default: the server's --slo-* flags; custom: a "
            "request's own targets)"
        )
    return name, slo
