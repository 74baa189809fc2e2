"""A simulated request: lengths, progress and the times its tokens came out (the simulator's
side of engine/request.py's `Request`, which holds tokens where this holds counts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bulletserve.sched.base import SeqView
from bulletserve.sched.slo import SLO

UNIQUE_TOKEN_SPAN = 1 << 40  # room for each request's own token ids


@dataclass(slots=True)
class SimRequest:
    """One request on the virtual clock. `token_times` are absolute simulated seconds; change
    them only through `add_token` so `num_tokens` stays in step."""

    request_id: str
    index: int
    arrival: float
    input_len: int
    output_len: int  # tokens it generates (max_tokens with ignore_eos)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_tokens: int = 0  # prompt plus generated tokens, as the engine's Request counts them
    # The prompt's tokens where the workload gives them (prompts that share prefixes); else
    # each token is one no other request has, as are generated ones (so the prefix cache finds
    # only what the request itself computed before a preemption).
    prompt_token_ids: tuple[int, ...] | None = None
    # Its output where known (a real run's, replayed: speculative decoding's drafts are then
    # the engine's proposer's over it, and held as far as they match it).
    output_token_ids: tuple[int, ...] | None = None
    priority: int = 0  # lower runs first
    slo: SLO | None = None  # its targets (the run's where the workload gives none)
    slo_class: str | None = None  # its class in a mixed workload
    # Drafts on offer to its next decode row and the chance each holds (sim/speculation.py).
    draft_count: int = 0
    draft_acceptance: float = 0.0
    _view: SeqView | None = None

    def __post_init__(self) -> None:
        self.num_tokens = self.input_len + len(self.token_times)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def num_draft_tokens(self) -> int:
        return self.draft_count

    @property
    def skips_prefix_cache(self) -> bool:
        return False  # a simulated request asks for no prompt logprobs

    @property
    def prefix_root(self) -> int:
        return 0  # nor has a cache salt

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output: the prompt's and the output's own where
        given, else ids of this request alone (negative, so no real token id equals one)."""
        unique = -(self.index + 1) * UNIQUE_TOKEN_SPAN
        given: tuple[int, ...] = self.prompt_token_ids or ()
        if given and self.output_token_ids is not None:
            given += self.output_token_ids
        own = max(start, len(given))
        return [*given[start:end], *range(unique - own, unique - max(own, end), -1)]

    def add_token(self, now: float) -> None:
        self.token_times.append(now)
        self.num_tokens += 1

    def view(self) -> SeqView:
        """The policy's view, rebuilt only when the request changed since the last one."""
        v = self._view
        if (
            v is None
            or v.num_tokens != self.num_tokens
            or v.num_computed_tokens != self.num_computed_tokens
            or v.num_blocks != len(self.block_table)
            or v.num_draft_tokens != self.draft_count
            or v.draft_acceptance != self.draft_acceptance
        ):
            v = self._view = SeqView(
                self.request_id,
                self.arrival,
                self.num_tokens,
                self.num_computed_tokens,
                len(self.block_table),
                priority=self.priority,
                slo=self.slo,
                first_token_time=self.token_times[0] if self.token_times else None,
                num_output_tokens=len(self.token_times),
                num_draft_tokens=self.draft_count,
                draft_acceptance=self.draft_acceptance,
            )
        return v
