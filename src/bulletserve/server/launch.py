"""Running the app under uvicorn, with a graceful shutdown that exits cleanly.

On SIGINT or SIGTERM uvicorn stops accepting connections and lets in-flight requests finish for
up to `shutdown_timeout` seconds. Shortly before that deadline the server ends what is left
itself (`end_requests`: a 503, or a stream's error event and `[DONE]`, each aborting its
request), because uvicorn would then cancel the tasks, cutting streams mid-body. Unlike
uvicorn's own handling, the signal is not re-raised afterwards, so the process exits 0.

When the engine dies (its thread's fault, its core process killed, a tensor-parallel rank gone,
every replica lost) the server does not stay up answering 503: within a tick (0.1 s) it logs
why, ends the open streams with an error event, shuts down as on a signal and records the
failure (`engine_failure`), for `bullet serve` to exit non-zero so that a supervisor (systemd,
Kubernetes, Ray) restarts it, as vLLM's server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)

# Benchmark clients (vLLM's, on aiohttp) keep idle pooled connections for up to 60 s; a server
# that closes them sooner makes the next request on one fail with a reset.
KEEP_ALIVE_S = 75


# A connection whose request headers have not all come this many seconds after its first byte
# (or after it opened) is closed: uvicorn itself times out only idle keep-alive connections, so
# a client sending part of a header could hold a connection open for ever.
HEADER_TIMEOUT_S = 30.0


class _HeaderDeadline:
    """Mixed into uvicorn's HTTP protocol (h11 or httptools, the class uvicorn would pick)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def _awaiting_headers(self) -> bool:
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._awaiting_headers():
            self._arm_header_timer()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)


def _http_protocol(header_timeout_s: float) -> type:
    """uvicorn's HTTP protocol class (httptools where installed, as uvicorn picks it, else h11)
    with the header deadline."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(f"{base.__name__}WithHeaderDeadline", (_HeaderDeadline, base), {
        "header_timeout_s": header_timeout_s
    })  # fmt: skip


# How long before the shutdown timeout the server ends the requests left (at most half of it):
# time for their last events to reach the clients.
END_REQUESTS_LEAD_S = 1.0


class _Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        end_requests: Callable[[str], None] | None,
        engine_failure: Callable[[], str | None] | None,
    ) -> None:
        super().__init__(config)
        self._end_requests = end_requests
        self._engine_failure = engine_failure
        self.engine_failure: str | None = None  # why the engine died, once it has

    async def on_tick(self, counter: int) -> bool:
        if self.engine_failure is None and self._engine_failure is not None:
            failure = self._engine_failure()
            if failure is not None:
                self.engine_failure = failure
                logger.error(
                    "the engine has died (%s): the server exits so that its supervisor can "
                    "restart it",
                    failure,
                )
                if self._end_requests is not None:
                    self._end_requests(f"the engine has died ({failure}); the server is exiting")
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ending = None
        if self._end_requests is not None:
            ending = asyncio.create_task(self._end_requests_before_the_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            if ending is not None:
                ending.cancel()

    async def _end_requests_before_the_deadline(self) -> None:
        timeout = self.config.timeout_graceful_shutdown or 0.0
        await asyncio.sleep(max(timeout - END_REQUESTS_LEAD_S, timeout / 2))
        if self.server_state.tasks:
            self._end_requests("the server shut down before the request finished")

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(
    app: FastAPI,
    host: str,
    port: int,
    shutdown_timeout: float,
    log_level: str = "info",
    end_requests: Callable[[str], None] | None = None,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    engine_failure: Callable[[], str | None] | None = None,
) -> _Server:
    """uvicorn serving `app`; `end_requests(message)` ends the requests still open shortly
    before the shutdown timeout, and when `engine_failure()` names why the engine died, the
    server ends them and shuts down (see the module's note)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_http_protocol(header_timeout_s),
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=shutdown_timeout,
        log_level=log_level,
        access_log=False,
    )
    return _Server(config, end_requests, engine_failure)
