"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """What to generate and when to stop; names follow vLLM and OpenAI.

    temperature 0 means greedy. `seed` makes one request's sampling reproducible whatever else
    runs beside it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per token, or None for none

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 for no limit), got {self.top_k}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
