"""The engine in a process of its own, behind an `EngineClient` (`bullet serve --engine-core
process`; the default on a GPU).

In-process (`AsyncEngine`) the engine's thread and the server's event loop share one
interpreter lock: while the loop formats and writes a step's chunks (about 50 us a stream) the
engine cannot plan or launch the next step, and a GPU waits. Here the engine core (policy,
bookkeeping, executor, detokenization, stops) runs in a child process on its own interpreter,
steps as soon as it has work, and sends each step's outputs as one message; the server's
process keeps the tokenizer for prompts, builds each stream's output from the deltas and writes
the chunks, while the core runs the next step.

Messages (pickled over two pipes; the engine's config first): to the core `("add", request id,
prompt ids, params, service, arrival, LoRA adapter name)`, `("abort", request id)`,
`("lora", token, "load" or "unload", name, path)`, `("stop",)`; from it `("ready", describe
lines)` or `("failed", exception)` once, then `("outputs", [deltas])` after each step,
`("rejected", request id, message)` for a request it refused (a 400; `"faulted"`: its handling
failed, a 500), `("stats", EngineStats)` a few times a second, `("lora_done", token, failure or
None, message)` for each load or unload, and `("dead", message)` when a step fails. A core that
dies or fails ends every open stream with `EngineDeadError` and turns `/health` to 503, as
in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from bulletserve.engine.async_engine import EngineDeadError, StreamEndedError
from bulletserve.engine.client import DecodingState, EngineStats, ModelFront
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.engine import LLMEngine
from bulletserve.engine.factory import create_engine
from bulletserve.engine.lora import UnknownAdapterError
from bulletserve.engine.request import RequestOutput, RequestTimings, TokenLogprob
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.engine.streams import StreamRegistry, stream_outputs
from bulletserve.sched.slo import ServiceClass

logger = logging.getLogger(__name__)

# How often the core reports its statistics (for /metrics, the stats log, num_running).
STATS_INTERVAL_S = 0.25
# How long the core may take to load its model and measure its device.
START_TIMEOUT_S = 900.0
# Grammar compiles and bad words' tokenization run beside the core's loop, this many at once.
DECODING_WORKERS = 2


@dataclass
class OutputDelta:
    """What a step added to one request's output: the part of a `RequestOutput` the server's
    process does not have yet (it has the prompt, and the text and tokens sent before)."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    new_logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None  # the first delta's only
    timings: RequestTimings
    num_preemptions: int
    num_cached_tokens: int

    @classmethod
    def of(cls, output: RequestOutput, first: bool) -> OutputDelta:
        seen = len(output.token_ids) - len(output.new_token_ids)
        return cls(
            output.request_id,
            output.new_text,
            output.new_token_ids,
            output.finished,
            output.finish_reason,
            output.logprobs[seen:] if output.logprobs is not None else None,
            output.prompt_logprobs if first else None,
            output.timings,
            output.num_preemptions,
            output.num_cached_tokens,
        )


@dataclass
class _Accumulated:
    """A request's output in the server's process so far, rebuilt from its deltas."""

    prompt: str | None
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def apply(self, delta: OutputDelta) -> RequestOutput:
        self.text += delta.new_text
        self.token_ids += delta.new_token_ids
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        return RequestOutput(
            request_id=delta.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            text=self.text,
            token_ids=self.token_ids[:],
            new_text=delta.new_text,
            new_token_ids=delta.new_token_ids,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            logprobs=self.logprobs[:] if self.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
            timings=delta.timings,
            num_preemptions=delta.num_preemptions,
            num_cached_tokens=delta.num_cached_tokens,
        )


class CoreProcess:
    """An `EngineClient` over an engine core in a child process."""

    def __init__(self, config: EngineConfig) -> None:
        self.front = ModelFront.load(config)
        # A process of its own (`python -m bulletserve.engine.core_process`, as the tensor-
        # parallel ranks start), not multiprocessing's spawn, which imports the caller's main
        # module again; two pipes passed down by descriptor, the config their first message.
        core_reads, server_writes = os.pipe()
        server_reads, core_writes = os.pipe()
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bulletserve.engine.core_process",
                f"--requests-fd={core_reads}",
                f"--outputs-fd={core_writes}",
                f"--log-level={logging.getLogger().getEffectiveLevel()}",
            ],
            pass_fds=(core_reads, core_writes),
        )
        os.close(core_reads)
        os.close(core_writes)
        self._requests = Connection(server_writes, readable=False)
        self._outputs = Connection(server_reads, writable=False)
        self._requests.send(config)
        self._send_lock = threading.Lock()
        self._streams = StreamRegistry()
        self._outputs_so_far: dict[str, _Accumulated] = {}  # by request id, while streamed
        self._stats = EngineStats()
        self._error: BaseException | None = None
        self._stopping = False
        # LoRA loads and unloads the core has yet to answer: token -> (loop, future).
        self._lora_waits: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        if not self._outputs.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:g} s")
        try:
            kind, payload = self._outputs.recv()
        except EOFError:
            raise RuntimeError(
                f"the engine core exited while starting (exit code {self._process.wait(5)})"
            ) from None
        if kind == "failed":
            self._process.wait(5)
            raise payload
        self._core_lines: list[str] = payload
        self._receiver = threading.Thread(
            target=self._receive, name="engine-core-outputs", daemon=True
        )
        self._receiver.start()

    # ---- EngineClient -------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.error is None

    @property
    def error(self) -> BaseException | None:
        """The core's fault, or its exit seen before its pipe's end was (a kill)."""
        if self._error is None and not self._stopping and self._process.poll() is not None:
            return EngineDeadError(f"the engine core exited ({exit_status(self._process)})")
        return self._error

    @property
    def num_running(self) -> int:
        return self._stats.num_running

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self._stats

    def describe(self) -> list[str]:
        return [
            *self._core_lines,
            f"engine: its own process (pid {self._process.pid}); it steps on while the server "
            "writes a step's tokens",
        ]

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        service: ServiceClass = ServiceClass(),
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As `AsyncEngine.generate`: outputs after every step that advanced the request, the
        last one finished; ValueError (bad input, as the core found it) before the first."""
        prompt_ids = self.front.tokenize(prompt)
        text = prompt if isinstance(prompt, str) else None
        queue = self._streams.open(request_id)
        self._outputs_so_far[request_id] = _Accumulated(text, prompt_ids)
        finished = False
        try:
            if not self.healthy:
                raise EngineDeadError(f"the engine core has failed: {self.error!r}")
            arrival = arrival_time or time.monotonic()
            self._send(("add", request_id, prompt_ids, params, service, arrival, lora))
            async for item in stream_outputs(queue):
                finished = item.finished
                yield item
        finally:
            self._streams.close(request_id)
            self._outputs_so_far.pop(request_id, None)
            if not finished and self.healthy:
                try:
                    self._send(("abort", request_id))
                except EngineDeadError:
                    pass  # nothing left to abort

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._lora("load", name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._lora("unload", name, None)

    async def _lora(self, operation: str, name: str, path: str | None) -> None:
        """Ask the core to load or unload an adapter and wait for its answer."""
        if not self.healthy:
            raise EngineDeadError(f"the engine core has failed: {self.error!r}")
        token = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._lora_waits[token] = (loop, future)
        try:
            self._send(("lora", token, operation, name, path))
            await future
        finally:
            self._lora_waits.pop(token, None)

    def end_streams(self, message: str) -> None:
        """End every open stream with StreamEndedError(message), which aborts its request.
        Called on the event loop the streams were opened on."""
        self._streams.end_all(StreamEndedError(message))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._process.poll() is None:
            try:
                self._send(("stop",))
                self._process.wait(timeout)
            except (EngineDeadError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait(5)
        self._requests.close()
        self.front.close()

    # ---- the server's side of the pipes -----------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._requests.send(message)
        except OSError as exc:  # the core has gone; its receiver fails the open streams
            raise EngineDeadError(f"the engine core is gone: {exc}") from None

    def _receive(self) -> None:
        """Pass the core's messages on until it ends; then fail what is still open."""
        try:
            while True:
                kind, *payload = self._outputs.recv()
                if kind == "outputs":
                    self._deliver(payload[0])
                elif kind == "stats":
                    self._stats = payload[0]
                elif kind == "rejected":
                    request_id, message = payload
                    self._streams.hand_over([(request_id, ValueError(message))])
                elif kind == "faulted":
                    request_id, message = payload
                    error = EngineDeadError(f"request {request_id}: {message}")
                    self._streams.hand_over([(request_id, error)])
                elif kind == "lora_done":
                    self._lora_done(*payload)
                elif kind == "dead":
                    self._error = EngineDeadError(f"engine fault: {payload[0]}")
                    break
        except (EOFError, OSError):
            if self._stopping:
                return
            try:
                self._process.wait(5)
                status = exit_status(self._process)
            except subprocess.TimeoutExpired:
                status = "no exit code: it closed its pipe and runs on"
            self._error = EngineDeadError(f"the engine core exited ({status})")
        logger.error("%s", self.error)
        self._streams.hand_over([(request_id, self.error) for request_id in self._streams.ids()])

    def _lora_done(self, token: str, failure: str | None, message: str) -> None:
        """The core's answer to a load or unload: none (done), or the error it raised."""
        waiting = self._lora_waits.get(token)
        if waiting is None:
            return
        loop, future = waiting
        error: BaseException | None = None
        if failure == "unknown":
            error = UnknownAdapterError(message)
        elif failure is not None:
            error = ValueError(message)

        def answer() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        loop.call_soon_threadsafe(answer)

    def _deliver(self, deltas: list[OutputDelta]) -> None:
        """A step's outputs to their streams (one wake-up per event loop): each stream's output
        rebuilt from its delta; the core runs on meanwhile."""
        items = []
        for delta in deltas:
            so_far = self._outputs_so_far.get(delta.request_id)
            if so_far is not None:
                items.append((delta.request_id, so_far.apply(delta)))
        self._streams.hand_over(items)


def exit_status(process: subprocess.Popen) -> str:
    """How an ended child process ended, in words: its exit code, or the signal that killed it."""
    code = process.returncode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---- the core's process ---------------------------------------------------------------------


def main() -> None:
    """The core's process: its config from the requests pipe, then the engine built on this
    (main) thread, which then steps it (the only thread that leads an OpenMP team, as in
    `AsyncEngine`), while a reader thread takes requests in."""
    parser = argparse.ArgumentParser(description="the engine core (started by bullet serve)")
    parser.add_argument("--requests-fd", type=int, required=True)
    parser.add_argument("--outputs-fd", type=int, required=True)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s core: %(message)s")
    requests = Connection(args.requests_fd, writable=False)
    outputs = Connection(args.outputs_fd, readable=False)
    config: EngineConfig = requests.recv()
    try:
        engine = create_engine(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which raises it
        try:
            outputs.send(("failed", exc))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            outputs.send(("failed", RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    Core(engine, requests, outputs).run()


class Core:
    """The engine core's loop in its process: requests from one pipe, outputs to the other."""

    def __init__(self, engine: LLMEngine, requests: Connection, outputs: Connection) -> None:
        self.engine = engine
        self.requests = requests
        self.outputs = outputs
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._started: set[str] = set()  # requests whose first output went out
        self._decoding = ThreadPoolExecutor(DECODING_WORKERS, thread_name_prefix="decoding")
        # Requests whose decoding state is being built -> whether an abort came meanwhile.
        self._preparing: dict[str, bool] = {}
        self._preparing_lock = threading.Lock()

    def run(self) -> None:
        self._send(("ready", self.engine.describe()))
        reader = threading.Thread(target=self._read, name="core-requests", daemon=True)
        reader.start()
        engine = self.engine
        last_stats = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_stats >= STATS_INTERVAL_S:
                    self._send(("stats", engine.stats()))
                    last_stats = now
                if not engine.has_unfinished():
                    self._wake.wait(STATS_INTERVAL_S)
                    self._wake.clear()
                    continue
                try:
                    step_outputs = engine.step()
                except Exception as exc:  # a fault fails every request; /health reports it
                    logger.exception("engine step failed")
                    self._send(("dead", repr(exc)))
                    return
                if step_outputs:
                    self._send(("outputs", [self._delta(o) for o in step_outputs]))
        finally:
            self._decoding.shutdown(wait=False, cancel_futures=True)
            engine.close()

    def _delta(self, output: RequestOutput) -> OutputDelta:
        first = output.request_id not in self._started
        if output.finished:
            self._started.discard(output.request_id)
        elif first:
            self._started.add(output.request_id)
        return OutputDelta.of(output, first)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.outputs.send(message)
        except OSError:  # the server's process has gone: stop too
            self._stop.set()
            self._wake.set()

    def _read(self) -> None:
        try:
            while True:
                kind, *payload = self.requests.recv()
                if kind == "add" and DecodingState.needs_work_off_loop(payload[2]):
                    # A grammar to compile or words to tokenize: beside the loop, not in its way.
                    with self._preparing_lock:
                        self._preparing[payload[0]] = False
                    self._decoding.submit(self._add, *payload)
                elif kind == "add":
                    self._add(*payload)
                elif kind == "abort":
                    with self._preparing_lock:
                        if payload[0] in self._preparing:  # not added yet: never will be
                            self._preparing[payload[0]] = True
                            continue
                    self.engine.abort_request(payload[0])
                    self._wake.set()
                elif kind == "lora":
                    self._decoding.submit(self._lora, *payload)
                elif kind == "stop":
                    break
        except (EOFError, OSError):
            pass  # the server's process has gone: stop too
        self._stop.set()
        self._wake.set()

    def _lora(self, token: str, operation: str, name: str, path: str | None) -> None:
        """Load or unload an adapter (off the reader: loading reads its file) and answer."""
        failure, message = None, ""
        try:
            if operation == "load":
                assert path is not None
                self.engine.load_lora_adapter(name, path)
            else:
                self.engine.unload_lora_adapter(name)
        except UnknownAdapterError as exc:
            failure, message = "unknown", str(exc)
        except ValueError as exc:
            failure, message = "invalid", str(exc)
        self._send(("lora_done", token, failure, message))

    def _add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        service: ServiceClass,
        arrival: float,
        lora: str | None = None,
    ) -> None:
        try:
            decoding = None
            if DecodingState.needs_work_off_loop(params):
                try:
                    decoding = self.engine.front.decoding_state(params)
                finally:
                    with self._preparing_lock:
                        aborted = self._preparing.pop(request_id, False)
                if aborted:  # its client left meanwhile
                    return
            self.engine.add_request(
                prompt_ids, params, request_id, arrival, service, decoding, lora
            )
        except ValueError as exc:
            self._send(("rejected", request_id, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - this request's fault alone; the core serves on
            logger.exception("request %s could not be added", request_id)
            self._send(("faulted", request_id, f"{type(exc).__name__}: {exc}"))
            return
        self._wake.set()


if __name__ == "__main__":
    # Run from the module by its own name, so that what the core pickles (OutputDelta) names
    # `bulletserve.engine.core_process`, not `__main__`, for the server to unpickle.
    from bulletserve.engine import core_process

    core_process.main()
