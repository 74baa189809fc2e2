"""The latency targets a request is held to, in the one form every part uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """Bullet's SLOs: TTFT per input token (ms), plus an optional fixed part, and TPOT (ms).

    A request of n input tokens meets its TTFT SLO when TTFT <= ttft_base_ms + n *
    ttft_per_token_ms. The paper's SLO is per token alone (base 0); a base lets the SLO stay a
    fixed multiple of the isolated latency, which has a fixed part, for very short prompts."""

    ttft_per_token_ms: float
    tpot_ms: float
    ttft_base_ms: float = 0.0

    def ttft_limit_ms(self, input_len: int) -> float:
        return self.ttft_base_ms + self.ttft_per_token_ms * max(input_len, 1)

    def ttft_s(self, input_len: int) -> float:
        return self.ttft_limit_ms(input_len) / 1e3

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1e3
