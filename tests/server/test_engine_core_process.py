"""The engine core in a process of its own (`--engine-core process`) behind the real server:
the same greedy outputs as the in-process engine (streamed and whole, logprobs rebuilt from the
deltas; and so under --async-scheduling, served by `bullet serve`), bad input refused as a 400,
a client that leaves frees its blocks, and a core that dies ends every open stream with an
error event and the server exits (non-zero, as `bullet serve`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.core_process import STATS_INTERVAL_S, CoreProcess
from bulletserve.engine.lora import UnknownAdapterError
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.server.metrics import ServerMetrics
from tests.server.harness import (
    ServerProcess,
    need_tokenizer,
    running_app,
    serving,
    tiny_engine,
    wait_until,
)

BODIES = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 2, "n": 2},
    {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1},
    # A grammar, compiled in the core beside its loop.
    {"prompt": "Pick", "max_tokens": 8, "temperature": 0, "guided_regex": "[0-9]{3}-[a-c]+"},
]


@pytest.fixture(scope="module")
def core():
    """One core process for the module's tests. Slow (about 8 s): its own interpreter loads
    torch and the model."""
    need_tokenizer()
    engine = CoreProcess(EngineConfig(model="tiny", load_format="dummy"))
    yield engine
    engine.shutdown()


def _answers(url: str) -> list[dict[int, tuple[str, list[str], list[float]]]]:
    """Each body whole, then streamed: per choice its text, tokens and their logprobs (a
    stream's chunks gathered per choice: choices interleave as their steps come)."""
    answers = []
    with httpx.Client(trust_env=False, timeout=60) as client:
        for body in BODIES:
            whole = client.post(url + "/v1/completions", json=body).json()
            choices = [(c["index"], c["text"], c["logprobs"]) for c in whole["choices"]]
            answers.append(_per_choice(choices))
            streamed = []
            with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line.removeprefix("data: "))
                        streamed += [
                            (c["index"], c["text"], c["logprobs"]) for c in chunk["choices"]
                        ]
            answers.append(_per_choice(streamed))
    return answers


def _per_choice(parts: list[tuple[int, str, dict | None]]) -> dict:
    choices: dict[int, tuple[str, list[str], list[float]]] = {}
    for index, text, logprobs in parts:
        so_far = choices.get(index, ("", [], []))
        tokens = logprobs["tokens"] if logprobs else []
        values = [v for v in logprobs["token_logprobs"] if v is not None] if logprobs else []
        choices[index] = (so_far[0] + text, so_far[1] + tokens, so_far[2] + values)
    return choices


@pytest.fixture(scope="module")
def in_process_answers():
    in_process = tiny_engine()
    try:
        with running_app(in_process) as url:
            return _answers(url)
    finally:
        in_process.shutdown()


def _assert_same_answers(answers: list[dict], expected: list[dict]) -> None:
    for got, want in zip(answers, expected, strict=True):
        assert got.keys() == want.keys()
        for index, (text, tokens, logprobs) in got.items():
            assert (text, tokens) == want[index][:2]
            # A row's logits may move in their last bits with the rows beside it in a step,
            # and the two engines' steps group the choices as their timing falls.
            assert logprobs == pytest.approx(want[index][2], abs=1e-4)


def test_the_core_process_answers_as_the_engine_in_process_does(core, in_process_answers):
    with running_app(core) as url:
        _assert_same_answers(_answers(url), in_process_answers)
    assert core.describe()[-1].startswith("engine: its own process (pid ")


def test_bad_input_found_by_the_core_is_a_value_error_before_any_output(core):
    too_long = [5] * (core.front.max_model_len + 1)  # past the check the server makes first
    with pytest.raises(ValueError, match="max-model-len"):
        asyncio.run(_first(core, too_long, "too-long"))
    assert asyncio.run(_first(core, [5, 6, 7], "fine")).new_token_ids  # the core serves on


async def _first(core: CoreProcess, prompt_ids: list[int], request_id: str):
    async for output in core.generate(prompt_ids, SamplingParams(max_tokens=2), request_id):
        return output


def test_a_client_that_leaves_mid_stream_is_aborted_and_frees_its_blocks(core):
    time.sleep(2 * STATS_INTERVAL_S)  # statistics sent after the earlier tests' requests
    before = core.stats().generation_tokens
    body = {"prompt": "Tell me", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with running_app(core) as url, httpx.Client(trust_env=False, timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    break
    assert wait_until(lambda: core.num_streams == 0)
    time.sleep(2 * STATS_INTERVAL_S)
    stats = core.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert 0 < stats.generation_tokens - before < 1000  # stopped early: aborted, not finished


def test_a_core_that_dies_ends_the_open_streams_and_the_server_exits():
    need_tokenizer()
    engine = CoreProcess(EngineConfig(model="tiny", load_format="dummy"))
    body = {"prompt": "Tell me", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with (
            serving(engine) as (url, server, thread),
            httpx.Client(trust_env=False, timeout=60) as client,
        ):
            lines = []
            with client.stream("POST", url + "/v1/completions", json=body) as reply:
                for line in filter(None, reply.iter_lines()):
                    lines.append(line)
                    if len(lines) == 3:
                        os.kill(engine._process.pid, signal.SIGKILL)
            events = [json.loads(x.removeprefix("data: ")) for x in lines[3:] if "{" in x]
            assert events and events[-1]["error"]["code"] in (500, 503), lines[-4:]
            assert "engine" in events[-1]["error"]["message"]
            assert lines[-1] == "data: [DONE]"
            thread.join(15)
            assert not thread.is_alive()  # the server shut down by itself
        assert server.engine_failure == (
            "EngineDeadError: the engine core exited (killed by SIGKILL)"
        )
        # A dead core's last figures are not reported as live.
        metrics = ServerMetrics(engine, "tiny").render().decode()
        assert 'bullet:engine_healthy{model_name="tiny"} 0.0' in metrics
        assert "bullet:num_requests_running" not in metrics
    finally:
        engine.shutdown()


def test_bullet_serve_under_async_scheduling_answers_as_serial_steps_and_exits_when_its_core_dies(
    tmp_path, in_process_answers
):
    """`bullet serve --engine-core process --async-scheduling` answers as the serial engine in
    process does; then, as a supervisor sees it, its core killed under an open stream: the
    stream ends with an error event and [DONE], and the server process exits 1 within
    seconds, its log saying why. Slow (about 25 s): the server and its core are two processes
    loading torch and the model, and every body runs whole and streamed."""
    server = ServerProcess(
        ["--model", "tiny", "--load-format", "dummy", "--engine-core", "process",
         "--async-scheduling", "--shutdown-timeout", "5"],
        tmp_path / "serve.log",
    )  # fmt: skip
    try:
        server.wait_ready()
        _assert_same_answers(_answers(server.url), in_process_answers)
        core_pid = int(re.search(r"its own process \(pid (\d+)\)", server.log()).group(1))
        body = {"prompt": "Tell me", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.Client(trust_env=False, timeout=60) as client:
            with client.stream("POST", server.url + "/v1/completions", json=body) as reply:
                for line in filter(None, reply.iter_lines()):
                    lines.append(line)
                    if len(lines) == 3:
                        os.kill(core_pid, signal.SIGKILL)
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert server.process.wait(timeout=30) == 1
        assert "the engine has died (EngineDeadError: the engine core exited (killed by " in (
            server.log()
        )
    finally:
        server.stop()


def test_lora_loads_and_unloads_cross_the_pipe_with_the_cores_answer(core):
    """The core's answer to a runtime adapter load or unload comes back as the engine's own
    error: this core serves no LoRA (its engine started without --enable-lora)."""
    with pytest.raises(ValueError, match="--enable-lora"):
        asyncio.run(core.load_lora_adapter("late", "/nowhere"))
    with pytest.raises(UnknownAdapterError, match="'late'"):
        asyncio.run(core.unload_lora_adapter("late"))
    assert core.healthy
