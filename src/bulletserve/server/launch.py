"""Running the app under uvicorn, with a graceful shutdown that exits cleanly.

On SIGINT or SIGTERM uvicorn stops accepting connections, lets in-flight requests finish for
up to `shutdown_timeout` seconds, then cancels the rest (which aborts them in the engine). Unlike
uvicorn's own handling, the signal is not re-raised afterwards, so the process exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

# Benchmark clients (vLLM's, on aiohttp) keep idle pooled connections for up to 60 s; a server
# that closes them sooner makes the next request on one fail with a reset.
KEEP_ALIVE_S = 75


class _Server(uvicorn.Server):
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
    app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str = "info"
) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=shutdown_timeout,
        log_level=log_level,
        access_log=False,
    )
    return _Server(config)
