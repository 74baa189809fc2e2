"""The engine for a config: under bullet on a CPU, built on the thread that runs its steps."""

from __future__ import annotations

from bulletserve.bookkeeping.clock import Clock
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.engine import LLMEngine, resolve_device
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
