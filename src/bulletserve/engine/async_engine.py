"""The engine on its own thread, with each request streaming into an asyncio queue.

The server awaits `generate(...)`; the engine thread steps while there is work and sleeps on an
event otherwise. A client that stops iterating (disconnects) aborts its request, which frees its
KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from bulletserve.engine.client import DecodingState, EngineStats, ModelFront
from bulletserve.engine.config import HANDOFF_WAIT_S, EngineConfig, waits_for_handoff
from bulletserve.engine.engine import LLMEngine
from bulletserve.engine.factory import create_engine
from bulletserve.engine.request import RequestOutput
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.engine.streams import StreamRegistry, stream_outputs
from bulletserve.sched.slo import ServiceClass

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread hit a fault; the request cannot complete."""


class StreamEndedError(RuntimeError):
    """The server ended the request's stream before the request finished (its shutdown)."""


class AsyncEngine:
    """An `EngineClient` over an engine in this process, on its own thread."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self._streams = StreamRegistry()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._startup_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(config, engine, ready), name="bullet-engine", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def _run(self, config: EngineConfig, engine: LLMEngine | None, ready: threading.Event) -> None:
        # The engine is built (weights loaded, hardware measured) on the thread that will run
        # it, so that only this thread ever leads an OpenMP team. GNU OpenMP cuts its workers'
        # spin-wait to ~100 iterations once it manages more threads than there are cores (a
        # second team on the event loop's thread would do that), and every parallel op then
        # pays a futex wake-up: measured +10-15 us per op on the 2-core CPU.
        try:
            self.engine = engine or create_engine(config)
            self.engine.life.acks_handoff = waits_for_handoff(self.engine.device.type)
        except BaseException as exc:
            self._startup_error = exc
            return
        finally:
            ready.set()
        self._loop()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def front(self) -> ModelFront:
        return self.engine.front

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def describe(self) -> list[str]:
        if self.engine.life.acks_handoff:
            arrangement = "waits for the event loop to write a step's tokens (at most "
            arrangement += f"{HANDOFF_WAIT_S * 1e3:g} ms) before the next: on a CPU the loop "
            arrangement += "would take a core from the compute team"
        else:
            arrangement = "steps on while the event loop writes a step's tokens"
        return [
            *self.engine.describe(),
            f"engine: a thread of the server process; it {arrangement}",
        ]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        service: ServiceClass = ServiceClass(),
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput after every step that advanced the request, the last one
        finished (`lora`: the name of its LoRA adapter). ValueError (bad input) is raised
        before the first yield."""
        decoding = None
        if DecodingState.needs_work_off_loop(params):
            # A grammar to compile or words to tokenize: never on the event loop. Built before
            # the request exists, so a client that leaves meanwhile leaves nothing behind.
            decoding = await asyncio.to_thread(self.engine.front.decoding_state, params)
        queue = self._streams.open(request_id)
        finished = False
        try:
            # Checked after registering: a fault from here on reaches this stream.
            if not self.healthy:
                raise EngineDeadError(f"the engine has failed: {self.error!r}")
            self.engine.add_request(
                prompt,
                params,
                request_id,
                arrival_time or time.monotonic(),
                service,
                decoding,
                lora,
            )
            self._wake.set()
            async for item in stream_outputs(queue):
                finished = item.finished
                yield item
        finally:
            self._streams.close(request_id)
            if not finished:
                self.engine.abort_request(request_id)
                self._wake.set()

    async def load_lora_adapter(self, name: str, path: str) -> None:
        # Reading the adapter's file: off the event loop, beside the engine's steps.
        await asyncio.to_thread(self.engine.load_lora_adapter, name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        self.engine.unload_lora_adapter(name)

    def end_streams(self, message: str) -> None:
        """End every open stream with StreamEndedError(message), which aborts its request.
        Called on the event loop the streams were opened on."""
        self._streams.end_all(StreamEndedError(message))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a fault fails every request; /health reports it
                logger.exception("engine step failed")
                self.error = exc
                self._fail_all(EngineDeadError(f"engine fault: {exc}"))
                return
            self._deliver([(output.request_id, output) for output in outputs])
            engine.outputs_handed_off()

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their streams with one wake-up per event loop (not one per
        request); on a CPU, then wait (bounded) until the loop has passed them on.

        The loop thread competes with the compute threads for the cores: if it formats and
        writes a step's tokens while the next step computes, it preempts one thread of the
        compute team, and the whole team waits for that thread at every barrier. Waiting here
        keeps the two apart."""
        handed = self._streams.hand_over(items)
        if self.engine.life.acks_handoff:
            for done in handed:
                done.wait(HANDOFF_WAIT_S)

    def _fail_all(self, error: BaseException) -> None:
        self._deliver([(request_id, error) for request_id in self._streams.ids()])
