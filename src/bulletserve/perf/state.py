"""The execution state ES of one engine step: what each lane runs and on how many units."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutionState:
    """One step of both lanes.

    prefill_lens[i] new tokens of prefill sequence i run on top of prefill_cached[i] tokens
    already in the KV cache (a cached prefix or earlier chunks). decode_ctx[i] is the context of
    decode sequence i including the token produced this step; the decode batch size is
    len(decode_ctx). The prefill lane runs prefill_layers layers starting at
    prefill_first_layer (None: all layers); decode always runs the whole model.
    """

    prefill_lens: tuple[int, ...] = ()
    prefill_cached: tuple[int, ...] = ()
    prefill_units: int = 0
    decode_ctx: tuple[int, ...] = ()
    decode_units: int = 0
    prefill_layers: int | None = None
    prefill_first_layer: int = 0

    def __post_init__(self) -> None:
        if self.prefill_cached and len(self.prefill_cached) != len(self.prefill_lens):
            raise ValueError("prefill_cached must have one entry per prefill sequence")

    @property
    def has_prefill(self) -> bool:
        return bool(self.prefill_lens)

    @property
    def has_decode(self) -> bool:
        return bool(self.decode_ctx)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.prefill_lens)

    @property
    def decode_batch(self) -> int:
        return len(self.decode_ctx)
