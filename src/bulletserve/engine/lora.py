"""The LoRA adapters an engine serves (`--enable-lora`): loaded by name from PEFT folders, each
load of a name a new generation (a request's prefix-cache keys carry its adapter's name and
generation, so a reloaded adapter never reuses the old one's KV)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

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


@dataclass(frozen=True)
class ServedAdapter:
    """A name served: where its adapter is read from, its load generation, rank and load time."""

    path: str
    generation: int
    rank: int
    load_s: float


class LoRARegistry:
    """Adapters by name, their weights on `device` in `dtype`; at most `max_resident` of them
    in memory (`--max-cpu-loras`; None: every one), the least recently used read again from its
    folder when next asked for. A request holds its adapter's weights while it runs."""

    def __init__(
        self,
        config: ModelConfig,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        max_resident: int | None = None,
    ) -> None:
        self.config = config
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.max_resident = max_resident
        self._served: dict[str, ServedAdapter] = {}
        self._resident: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self._generations: dict[str, int] = {}

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read the adapter at `path` under `name` (replacing one of that name: a new load
        generation); `model.peft.AdapterError` naming what we cannot serve."""
        generation = self._generations.get(name, -1) + 1
        adapter = self._read(name, path, generation)
        self._generations[name] = generation
        self._served[name] = ServedAdapter(path, generation, adapter.weights.rank, adapter.load_s)
        logger.info(
            "LoRA adapter %s from %s: rank %d, %.1f MB, loaded in %.2f s",
            name,
            path,
            adapter.weights.rank,
            adapter.weights.nbytes / 1e6,
            adapter.load_s,
        )
        return adapter

    def unload(self, name: str) -> None:
        """KeyError where no adapter has the name."""
        del self._served[name]
        self._resident.pop(name, None)

    def get(self, name: str) -> LoadedAdapter | None:
        """The adapter served as `name` (read again from its folder where it left memory), or
        None where none is."""
        served = self._served.get(name)
        if served is None:
            return None
        adapter = self._resident.get(name)
        if adapter is not None:
            self._resident.move_to_end(name)
            return adapter
        return self._read(name, served.path, served.generation)

    def resolve(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter a request names, loaded from its path where it is not served yet (as
        vLLM's offline `LLM.generate(..., lora_request=...)` does)."""
        adapter = self.get(request.lora_name)
        if adapter is None:
            adapter = self.load(request.lora_name, request.lora_path)
        return adapter

    @property
    def served(self) -> Mapping[str, ServedAdapter]:
        """The names served (read-only)."""
        return MappingProxyType(self._served)

    @property
    def num_resident(self) -> int:
        return len(self._resident)

    def _read(self, name: str, path: str, generation: int) -> LoadedAdapter:
        started = time.perf_counter()
        weights = read_adapter(path, self.config, self.max_rank, self.dtype)
        if self.device.type != "cpu":
            weights = weights.to(self.device)
        adapter = LoadedAdapter(name, path, generation, weights, time.perf_counter() - started)
        self._resident[name] = adapter
        self._resident.move_to_end(name)
        while self.max_resident is not None and len(self._resident) > self.max_resident:
            self._resident.popitem(last=False)
        return adapter
