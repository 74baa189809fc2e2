"""LoRA on our projections: an adapter's low-rank updates laid onto the fused projections
(`AdapterWeights`, read from PEFT's format by `model.peft`), and a step's rows with the adapter
of each (`LoRABatch`): each projection's update is one shrink (the rows times every adapter's
A of the step, stacked), each row's columns of the other adapters zeroed, and one expand (the
B side by side), whatever the number of adapters; Punica's SGMV and vLLM's `lora_shrink` /
`lora_expand` compute each row against its own adapter alone, which a CPU pays for in calls
per group (measured: 4 adapters among 16 rows, 0.54x the base's output). A step with no
adapter row has no batch at all."""

from __future__ import annotations

from collections import OrderedDict
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
class _Stacked:
    """One projection's update for a set of adapters at once: their A stacked (`a` [C, in]),
    their B side by side (`b` [out, C]), and each column's adapter (its index in the set)."""

    a: torch.Tensor
    b: torch.Tensor
    owners: torch.Tensor  # [C]


class AdapterStacks:
    """Each set of adapters that steps have met, its projections stacked (`_Stacked`): built
    once per set, so a step's update is one shrink and one expand per projection whatever the
    number of adapters in it. A few sets are kept, the least recently used dropped."""

    SETS = 8

    def __init__(self) -> None:
        self._sets: OrderedDict[
            tuple[int, ...],
            tuple[tuple[AdapterWeights, ...], list[dict[str, _Stacked]]],
        ] = OrderedDict()

    def of(self, adapters: tuple[AdapterWeights, ...]) -> list[dict[str, _Stacked]]:
        """Per layer and projection, the set's stacked updates."""
        key = tuple(id(weights) for weights in adapters)
        hit = self._sets.get(key)
        if hit is not None:
            self._sets.move_to_end(key)
            return hit[1]
        stacks = [_stack(adapters, layer) for layer in range(len(adapters[0].layers))]
        # The set's weights are kept with their stacks, so that no other adapter takes their ids.
        self._sets[key] = (adapters, stacks)
        while len(self._sets) > self.SETS:
            self._sets.popitem(last=False)
        return stacks


def _stack(adapters: tuple[AdapterWeights, ...], layer: int) -> dict[str, _Stacked]:
    stacks = {}
    for projection in ("qkv", "o", "gate_up", "down"):
        parts = [
            (index, update)
            for index, weights in enumerate(adapters)
            if (update := weights.layers[layer].get(projection)) is not None
        ]
        if not parts:
            continue
        owners = torch.cat(
            [torch.full((u.a.shape[0],), i, dtype=torch.int32) for i, u in parts]
        ).to(parts[0][1].a.device)
        stacks[projection] = _Stacked(
            torch.cat([u.a for _, u in parts]).contiguous(),
            torch.cat([u.b for _, u in parts], dim=1).contiguous(),
            owners,
        )
    return stacks


class LoRABatch:
    """A step's rows and the adapter of each (`owners`: its index in the step's set, -1 for
    none), and the set's stacked updates."""

    def __init__(self, stacks: list[dict[str, _Stacked]], owners: torch.Tensor) -> None:
        self.stacks = stacks
        self.owners = owners
        self._masks: dict[int, torch.Tensor] = {}

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """`out` (the base projection of `x`) with each row's adapter's update added: the
        rows shrunk by every adapter's A at once, each row's columns of other adapters
        zeroed, then expanded by the B side by side."""
        stacked = self.stacks[layer].get(projection)
        if stacked is None:
            return out
        dtype = stacked.a.dtype  # --lora-dtype's
        mask = self._masks.get(id(stacked.owners))
        if mask is None:
            mask = (self.owners.unsqueeze(1) == stacked.owners.unsqueeze(0)).to(dtype)
            self._masks[id(stacked.owners)] = mask
        shrunk = (x.to(dtype) @ stacked.a.T).mul_(mask)
        if dtype == out.dtype:
            return out.addmm_(shrunk, stacked.b.T)
        return out.add_((shrunk @ stacked.b.T).to(out.dtype))


def lora_batch(
    spans: list[tuple[AdapterWeights | None, int, int]],
    rows: int,
    stacks: AdapterStacks,
    device: torch.device,
) -> LoRABatch | None:
    """The batch of a step of `rows` rows (padding included) whose sequences' rows
    [start, end) use each its adapter (None: the base alone); None where no row uses one."""
    adapters: dict[int, int] = {}  # id -> index in the set
    chosen: list[AdapterWeights] = []
    owners = torch.full((rows,), -1, dtype=torch.int32)
    for weights, start, end in spans:
        if weights is None or end <= start:
            continue
        index = adapters.get(id(weights))
        if index is None:
            index = adapters[id(weights)] = len(chosen)
            chosen.append(weights)
        owners[start:end] = index
    if not chosen:
        return None
    return LoRABatch(stacks.of(tuple(chosen)), owners.to(device))
