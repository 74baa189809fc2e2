"""Speculative decoding's counters, as vLLM exports them (`vllm:spec_decode_*`)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    """Since start: verified rows that carried drafts, their drafted tokens, the accepted ones
    (also per draft position). Two readings' difference (`-`) is what happened between them;
    replicas' counters add (`+`)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combined(other, operator.add)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return self._combined(other, operator.sub)

    def _combined(self, other: SpecCounters, op: Callable[[int, int], int]) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        return SpecCounters(
            op(self.num_drafts, other.num_drafts),
            op(self.num_draft_tokens, other.num_draft_tokens),
            op(self.num_accepted_tokens, other.num_accepted_tokens),
            [op(a, b) for a, b in zip(mine, theirs, strict=True)],
        )

    def copy(self) -> SpecCounters:
        """The counters now (the engine's go on counting)."""
        return self + SpecCounters()

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verified row made on average: its accepted drafts and the one it draws."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
