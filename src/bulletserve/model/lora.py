"""LoRA on our projections: an adapter's low-rank updates laid onto the fused projections
(`AdapterWeights`, read from PEFT's format by `model.peft`), and a step's rows grouped by
adapter (`LoRABatch`), each projection's update added to its output group by group: one shrink
(x A) and one expand (. B, scaled) per group, as Punica's SGMV and vLLM's `lora_shrink` /
`lora_expand` do. Rows of no adapter pay nothing, and a step with none has no batch at all."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAProjection:
    """One projection's low-rank update, its output `x @ a.T @ b.T`: `a` [R, in] stacks its
    parts' A, `b` [out, R] holds each part's B, scaled, in the part's output rows and its own
    rank's columns (zeros elsewhere), R the parts' ranks together."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter's updates per layer and projection (`qkv`, `o`, `gate_up`, `down`; a
    projection it does not target is absent) and its rank."""

    rank: int
    layers: tuple[dict[str, LoRAProjection], ...]

    def to(self, device: torch.device) -> AdapterWeights:
        layers = tuple(
            {name: LoRAProjection(p.a.to(device), p.b.to(device)) for name, p in layer.items()}
            for layer in self.layers
        )
        return AdapterWeights(self.rank, layers)

    @property
    def nbytes(self) -> int:
        return sum(
            p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
            for layer in self.layers
            for p in layer.values()
        )


@dataclass(frozen=True)
class LoRAGroup:
    """An adapter and the step's rows that use it (a slice where they are contiguous)."""

    weights: AdapterWeights
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class LoRABatch:
    groups: tuple[LoRAGroup, ...]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """`out` (the base projection of `x`) with each group's update added to its rows."""
        for group in self.groups:
            update = group.weights.layers[layer].get(projection)
            if update is None:
                continue
            rows = group.rows
            if isinstance(rows, slice):
                delta = (x[rows] @ update.a.T) @ update.b.T
                out[rows] += delta.to(out.dtype)
            else:
                delta = (x.index_select(0, rows) @ update.a.T) @ update.b.T
                out.index_add_(0, rows, delta.to(out.dtype))
        return out


def lora_batch(
    spans: list[tuple[AdapterWeights | None, int, int]], device: torch.device
) -> LoRABatch | None:
    """The batch of a step whose sequences' rows [start, end) use each its adapter (None: the
    base alone); None where no row uses one."""
    by_adapter: dict[int, tuple[AdapterWeights, list[tuple[int, int]]]] = {}
    for weights, start, end in spans:
        if weights is not None and end > start:
            by_adapter.setdefault(id(weights), (weights, []))[1].append((start, end))
    if not by_adapter:
        return None
    groups = []
    for weights, ranges in by_adapter.values():
        ranges.sort()
        contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        if contiguous:
            rows: slice | torch.Tensor = slice(ranges[0][0], ranges[-1][1])
        else:
            rows = torch.cat([torch.arange(s, e) for s, e in ranges]).to(device)
        groups.append(LoRAGroup(weights, rows))
    return LoRABatch(tuple(groups))
