"""What an executor carries the policy's plans out with, handed to it by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

import torch

from bulletserve.bookkeeping.book import RequestBook
from bulletserve.bookkeeping.clock import Clock
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.draft_model import DraftModel
from bulletserve.engine.life import RequestLife
from bulletserve.engine.model_runner import ModelRunner
from bulletserve.engine.request import Request
from bulletserve.engine.sampler import Sampler
from bulletserve.model.decoder import DecoderLM


@dataclass(frozen=True)
class EngineParts:
    """The engine's settings and clock, its request book and requests' life (to which an
    executor hands the tokens its steps sampled), this rank's device side, the sampler, the
    step log and, under speculative decoding's draft_model, the draft model."""

    config: EngineConfig
    clock: Clock
    book: RequestBook[Request]
    life: RequestLife
    model: DecoderLM
    runner: ModelRunner
    sampler: Sampler
    device: torch.device
    dtype: torch.dtype
    step_log: TextIO | None
    draft: DraftModel | None = None
