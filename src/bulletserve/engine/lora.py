"""The LoRA adapters an engine serves (`--enable-lora`): loaded by name from PEFT folders, each
load of a name a new generation (a request's prefix-cache keys carry its adapter's name and
generation, so a reloaded adapter never reuses the old one's KV)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from bulletserve.model.config import ModelConfig
from bulletserve.model.lora import AdapterWeights
from bulletserve.model.peft import read_adapter

logger = logging.getLogger(__name__)


class UnknownAdapterError(ValueError):
    """A request names an adapter the engine does not hold (the server's 404)."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest`: the adapter a request runs with, by name (loaded from `lora_path`
    on first use)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    generation: int  # how many times an adapter of this name was loaded before
    weights: AdapterWeights
    load_s: float

    @property
    def identity(self) -> str:
        """What a request's prefix-cache keys carry for it."""
        return f"lora:{self.name}:{self.generation}"


class LoRARegistry:
    """Adapters by name, their weights on `device` in `dtype`."""

    def __init__(
        self, config: ModelConfig, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self._adapters: dict[str, LoadedAdapter] = {}
        self._generations: dict[str, int] = {}

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read the adapter at `path` under `name` (replacing one of that name);
        `model.peft.AdapterError` naming what we cannot serve."""
        started = time.perf_counter()
        weights = read_adapter(path, self.config, self.max_rank, self.dtype)
        if self.device.type != "cpu":
            weights = weights.to(self.device)
        generation = self._generations.get(name, -1) + 1
        self._generations[name] = generation
        adapter = LoadedAdapter(name, path, generation, weights, time.perf_counter() - started)
        self._adapters[name] = adapter
        logger.info(
            "LoRA adapter %s from %s: rank %d, %.1f MB, loaded in %.2f s",
            name,
            path,
            weights.rank,
            weights.nbytes / 1e6,
            adapter.load_s,
        )
        return adapter

    def unload(self, name: str) -> None:
        """KeyError where no adapter has the name."""
        del self._adapters[name]

    def get(self, name: str) -> LoadedAdapter | None:
        return self._adapters.get(name)

    def resolve(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter a request names, loaded from its path where it is not yet (as vLLM's
        offline `LLM.generate(..., lora_request=...)` does)."""
        adapter = self._adapters.get(request.lora_name)
        if adapter is None:
            adapter = self.load(request.lora_name, request.lora_path)
        return adapter

    @property
    def adapters(self) -> list[LoadedAdapter]:
        return list(self._adapters.values())
