"""The server's periodic log line, as vLLM prints it: throughput, queues, KV cache, prefix hits."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from bulletserve.engine.client import EngineClient, EngineStats
from bulletserve.server.settings import STATS_INTERVAL_S
from bulletserve.spec.counters import SpecCounters

logger = logging.getLogger(__name__)


@dataclass
class StatsLog:
    """Every `interval_s`, a line of what the engine did since the last one; nothing while it
    stays idle (a line still reports the interval in which it fell idle)."""

    engine: EngineClient
    interval_s: float = STATS_INTERVAL_S
    _last: tuple[float, EngineStats] = field(
        default_factory=lambda: (time.monotonic(), EngineStats())
    )
    _was_busy: bool = False

    def line(self, stats: EngineStats, now: float) -> str | None:
        then, last = self._last
        self._last = (now, stats)
        seconds = max(now - then, 1e-9)
        prompt = (stats.prompt_tokens - last.prompt_tokens) / seconds
        generation = (stats.generation_tokens - last.generation_tokens) / seconds
        busy = bool(prompt or generation or stats.num_running or stats.num_waiting)
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        hit_rate = hits / queries if queries else 0.0
        text = (
            f"prompt throughput: {prompt:.1f} tokens/s, generation throughput: "
            f"{generation:.1f} tokens/s, running: {stats.num_running} reqs, waiting: "
            f"{stats.num_waiting} reqs, KV cache usage: {usage:.1%}, prefix cache hit rate: "
            f"{hit_rate:.1%}"
        )
        if stats.spec is not None:
            spec = stats.spec - (last.spec or SpecCounters())
            rate, length = spec.acceptance_rate or 0.0, spec.mean_acceptance_length or 1.0
            text += f", draft acceptance rate: {rate:.1%}, mean acceptance length: {length:.2f}"
        return text

    async def run(self) -> None:
        self._last = (time.monotonic(), self.engine.stats())
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.engine.healthy:
                return  # a dead engine's last figures are not live; the server is exiting
            text = self.line(self.engine.stats(), time.monotonic())
            if text is not None:
                logger.info(text)
