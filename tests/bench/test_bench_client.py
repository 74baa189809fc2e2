"""The streaming client against a real HTTP server on a loopback port that sends server-sent
events as an OpenAI server may: generated text with characters that JSON leaves unescaped."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from bulletserve.bench.http_client import Target, make_client, send_request
from bulletserve.bench.records import RequestRecord
from bulletserve.server.launch import make_server
from tests.server.harness import free_port

# U+2028, U+2029 and U+0085 end a line for str.splitlines (and so for httpx's aiter_lines),
# not for server-sent events; CR LF and a lone CR do end an SSE line.
PIECES = ["line\u2028separator", "para\u2029graph", "next\u0085line"]


def _events() -> list[bytes]:
    events = [
        json.dumps({"choices": [{"index": 0, "text": piece}]}, ensure_ascii=False)
        for piece in PIECES
    ]
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    body = f"data: {events[0]}\n\ndata: {events[1]}\r\n\r\ndata: {events[2]}\r\r"
    body += f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
    raw = body.encode()
    # Chunks that cut lines, a CR LF and a multi-byte character apart.
    cut = sorted([7, raw.index(b"\r\n") + 1, raw.index("\u2029".encode()) + 1, len(raw) - 9])
    return [raw[a:b] for a, b in zip([0, *cut], [*cut, len(raw)], strict=True)]


def test_generated_line_separators_do_not_split_an_event():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def stream():
            for chunk in _events():
                yield chunk
                await asyncio.sleep(0.01)

        return StreamingResponse(stream(), media_type="text/event-stream")

    port = free_port()
    server = make_server(app, "127.0.0.1", port, shutdown_timeout=5, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    record = RequestRecord(index=0, input_len=4, max_tokens=3, arrival_s=0.0)

    async def send() -> None:
        async with make_client(None, 30.0) as client:
            target = Target(f"http://127.0.0.1:{port}", "m")
            await send_request(client, target, "hi", record, len, time.perf_counter())

    try:
        asyncio.run(asyncio.wait_for(send(), 60))
    finally:
        server.should_exit = True
        thread.join(15)
    assert record.error is None and record.success
    assert len(record.token_times_s) == 3
    assert record.output_len == 3


def test_the_request_carries_the_temperature_only_when_one_is_given():
    """`bullet bench --temperature T` sends T with every request, as vLLM's client does;
    without it the server's default (and its model's generation config) applies."""
    assert "temperature" not in Target("http://127.0.0.1:1", "m").payload("hi", 4)
    body = Target("http://127.0.0.1:1", "m", ignore_eos=True, temperature=0.0).payload("hi", 4)
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True


def test_requests_name_the_lora_adapters_in_turn():
    """`bullet bench --lora-modules a,b base`: request i names the i-th name, round robin."""
    target = Target("http://127.0.0.1:1", "base", lora_modules=("a", "b", "base"))
    assert [target.payload("hi", 4, None, i)["model"] for i in range(5)] == [
        "a", "b", "base", "a", "b"
    ]  # fmt: skip
    assert Target("http://127.0.0.1:1", "base").payload("hi", 4, None, 3)["model"] == "base"
