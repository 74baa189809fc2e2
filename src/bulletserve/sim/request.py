"""A simulated request: lengths, progress and the times its tokens came out."""

from __future__ import annotations

from dataclasses import dataclass, field

from bulletserve.sched.base import SeqView


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
    num_tokens: int = 0  # prompt plus generated tokens, as the engine's Request counts them
    _view: SeqView | None = None

    def __post_init__(self) -> None:
        self.num_tokens = self.input_len + len(self.token_times)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

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
        ):
            v = self._view = SeqView(
                self.request_id,
                self.arrival,
                self.num_tokens,
                self.num_computed_tokens,
                len(self.block_table),
            )
        return v
