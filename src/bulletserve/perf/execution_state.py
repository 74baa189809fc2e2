"""The execution state ES of one engine step: what each lane runs and on how many units."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ExecutionState:
    """One step of both lanes.

    prefill_lens[i] new tokens of prefill sequence i run on top of prefill_cached[i] tokens
    already in the KV cache (a cached prefix or earlier chunks). decode_ctx[i] is the context of
    decode sequence i including the token produced this step; the decode batch size is
    len(decode_ctx). Under speculative decoding decode_drafts[i] more tokens ride in row i (its
    drafts, each with logits to verify; empty: none anywhere). The prefill lane runs
    prefill_layers layers starting at prefill_first_layer (None: all layers); decode always
    runs the whole model.
    """

    prefill_lens: tuple[int, ...] = ()
    prefill_cached: tuple[int, ...] = ()
    prefill_units: int = 0
    decode_ctx: tuple[int, ...] = ()
    decode_units: int = 0
    decode_drafts: tuple[int, ...] = ()
    prefill_layers: int | None = None
    prefill_first_layer: int = 0

    def __post_init__(self) -> None:
        if self.prefill_cached and len(self.prefill_cached) != len(self.prefill_lens):
            raise ValueError("prefill_cached must have one entry per prefill sequence")
        if self.decode_drafts and len(self.decode_drafts) != len(self.decode_ctx):
            raise ValueError("decode_drafts must have one entry per decode sequence")

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

    @property
    def decode_rows(self) -> int:
        """Decode tokens computed, each with its logits: a row per sequence and its drafts."""
        return len(self.decode_ctx) + sum(self.decode_drafts)

    def to_json(self) -> dict:
        """The state as the step log writes it (lists for tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> ExecutionState:
        """The state a step log line holds (`to_json`'s form)."""
        known = {f.name for f in fields(cls)}
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        )


def fused_step_state(
    prefill: list[tuple[int, int]],
    decode_ctx: list[int],
    units: int,
    decode_drafts: list[int] | None = None,
) -> tuple[ExecutionState, str]:
    """The state of one single-lane step on every unit, and the phase whose time it takes.

    `prefill` holds (new tokens, cached tokens) per prefill chunk, `decode_ctx` each decoding
    request's context including the token it feeds. A step with both is one fused batch
    (chunked prefill's hybrid step): it is modeled as a prefill whose rows are the chunks plus
    one token per decode on top of that decode's cached context. `decode_drafts`: each decode
    row's drafts (speculative decoding; None: none), tokens of its row; in a fused step they
    are priced as prompt tokens, whose logits the model takes for one row per sequence.
    """
    drafts = tuple(decode_drafts) if decode_drafts and any(decode_drafts) else ()
    if not prefill:
        state = ExecutionState(
            decode_ctx=tuple(decode_ctx), decode_units=units, decode_drafts=drafts
        )
        return state, "decode"
    lens = tuple(n for n, _ in prefill) + tuple(1 + d for d in drafts or (0,) * len(decode_ctx))
    cached = tuple(c for _, c in prefill) + tuple(c - 1 for c in decode_ctx)
    state = ExecutionState(
        prefill_lens=lens,
        prefill_cached=cached if any(cached) else (),
        prefill_units=units,
    )
    return state, "prefill"
