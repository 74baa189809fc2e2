"""Pick the executor for a policy: one lane for chunked and prefill-first, two for bullet."""

from __future__ import annotations

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.engine import LLMEngine, resolve_device
from bulletserve.executor.clock import Clock
from bulletserve.partition import TeamThread


def create_engine(config: EngineConfig, clock: Clock | None = None) -> LLMEngine:
    """`clock`: the wall clock unless a test gives a virtual one."""
    if config.policy != "bullet" or resolve_device(config.device).type != "cpu":
        return LLMEngine(config, clock=clock)
    # Built on the thread that will run its lanes' multi-threaded steps (partition.TeamThread).
    team = TeamThread()
    try:
        return team.call(lambda: LLMEngine(config, clock=clock, team=team))
    except BaseException:
        team.stop()
        raise
