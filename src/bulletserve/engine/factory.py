"""Pick the executor for a policy: one lane for chunked and prefill-first, two for bullet."""

from __future__ import annotations

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.engine import LLMEngine


def create_engine(config: EngineConfig) -> LLMEngine:
    if config.policy == "bullet":
        from bulletserve.engine.lanes import LanedEngine

        return LanedEngine(config)
    return LLMEngine(config)
