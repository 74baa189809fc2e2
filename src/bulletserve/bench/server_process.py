"""A server under benchmark in a process of its own (ours or a peer's): started in its own
session with its output in a log file, waited for until `/health` answers, and stopped with
its whole process tree (SIGTERM, then SIGKILL past a grace period). The harnesses in
benchmarks/ and scripts/ start every server they measure through it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`command` running as a server on `port` of the loopback address."""

    def __init__(
        self, command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.command = command
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = log_path.open("w")
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 600, poll_s: float = 2.0) -> None:
        """Until `/health` answers 200; RuntimeError if the process exits first, TimeoutError
        past `timeout_s`, each naming the log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.process.returncode}; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(poll_s)
        raise TimeoutError(f"the server did not answer within {timeout_s:g} s; see {self.log_path}")

    def stop(self, grace_s: float = 60) -> None:
        """SIGTERM to the server's process group, SIGKILL if it outlives `grace_s`."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
