"""The benchmark harnesses' server lifecycle (`bench.server_process`): ready once `/health`
answers, stopped with its process group, and a server that exits first named with its log."""

from __future__ import annotations

import sys

import psutil
import pytest

from bulletserve.bench.server_process import ServerProcess, free_port
from tests.server.harness import wait_until

# A server that answers 200 on every GET, and starts a child of its own (its process group
# must end with it).
HEALTHY = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
print("child", child.pid, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


def test_a_server_is_ready_when_health_answers_and_stops_with_its_children(tmp_path):
    port = free_port()
    server = ServerProcess([sys.executable, "-c", HEALTHY, str(port)], port, tmp_path / "s.log")
    server.wait_ready(timeout_s=30, poll_s=0.05)
    server.stop(grace_s=10)
    assert server.process.returncode is not None
    child = int((tmp_path / "s.log").read_text().split()[1])
    assert wait_until(lambda: _ended(child), timeout_s=10)  # with its process group


def _ended(pid: int) -> bool:
    """Gone, or a zombie its new parent has not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_that_exits_first_is_named_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"]
    server = ServerProcess(command, free_port(), tmp_path / "s.log")
    with pytest.raises(RuntimeError, match=r"exited with code 3; see .*s\.log"):
        server.wait_ready(timeout_s=30, poll_s=0.05)
    server.stop()
