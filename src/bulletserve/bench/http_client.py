"""The streaming HTTP client: one OpenAI-compatible request, timed chunk by chunk.

Timing follows vLLM's request functions: the clock starts just before the request is sent; each
server-sent event whose choice carries output (a completions `text`, a chat `delta.content`,
possibly empty for special tokens) is one output chunk; TTFT is the first chunk's time and E2EL
the last one's. Chat events that only announce the assistant role carry no token and are
skipped. The output token count is the server's `usage.completion_tokens`
(`stream_options.include_usage`), else the tokenizer's count of the streamed text.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from bulletserve.bench.classes import WorkloadClass
from bulletserve.bench.records import RequestRecord
from bulletserve.spec.counters import SpecCounters

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def server_root(base_url: str) -> str:
    """The server's root URL from `base_url` as a user gives it: with or without a trailing
    slash, or in the OpenAI SDK's form, ending in /v1."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class ServerUnreachable(RuntimeError):
    """No connection could be made to the server at all."""


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None  # None: the server's default
    # A mixed workload's requests name their class's priority and SLO class (the server's
    # --scheduling-policy priority and --slo-class).
    send_priority: bool = False
    send_slo: bool = False
    # LoRA adapters (or the base model's name) the requests name in turn (none: `model`).
    lora_modules: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(
        self,
        prompt: str,
        max_tokens: int,
        workload_class: WorkloadClass | None = None,
        index: int = 0,
    ) -> dict:
        """Request number `index`'s body."""
        model = self.model
        if self.lora_modules:
            model = self.lora_modules[index % len(self.lora_modules)]
        body: dict = {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = max_tokens
        else:
            body["prompt"] = prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if workload_class is not None and self.send_priority:
            body["priority"] = workload_class.priority
        if workload_class is not None and self.send_slo:
            body["slo"] = workload_class.name
        return body


def make_client(max_connections: int | None, timeout_s: float) -> httpx.AsyncClient:
    """A pooled client. Idle connections are dropped after 4 s, before a server's idle timeout
    (uvicorn's default is 5 s) can reset a connection the pool is about to reuse."""
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=None, keepalive_expiry=4.0
    )
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


async def list_models(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> list[dict]:
    """The server's /v1/models entries; ServerUnreachable if nothing answers at base_url."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.get(url, headers=headers, timeout=30.0)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol) as exc:
        raise ServerUnreachable(f"cannot reach a server at {base_url} ({exc})") from None
    if response.status_code != 200:
        raise ServerUnreachable(f"GET {url} answered HTTP {response.status_code}")
    try:
        return list(response.json().get("data", []))
    except (ValueError, AttributeError):
        raise ServerUnreachable(f"GET {url} did not return an OpenAI model list") from None


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    prompt: str,
    record: RequestRecord,
    count_tokens: Callable[[str], int],
    clock_origin: float,
    workload_class: WorkloadClass | None = None,
) -> None:
    """Send one streaming request and fill in `record` (success, times, output length, error)."""
    text_parts: list[str] = []
    usage_tokens: int | None = None
    done = False
    start = time.perf_counter()
    record.start_s = start - clock_origin
    try:
        async with client.stream(
            "POST",
            target.url,
            json=target.payload(prompt, record.max_tokens, workload_class, record.index),
            headers=target.headers,
        ) as response:  # fmt: skip
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:200]
                record.error = f"HTTP {response.status_code}: {body}"
                return
            async for line in sse_lines(response):
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (":"), other SSE fields
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if not isinstance(event, dict):
                    record.error = f"malformed stream event: {data[:100]}"
                    return
                if "error" in event:
                    record.error = f"server error: {json.dumps(event['error'])[:200]}"
                    return
                piece = _output_piece(event, target.endpoint)
                if piece is not None:
                    record.token_times_s.append(now - start)
                    text_parts.append(piece)
                usage = event.get("usage")
                if isinstance(usage, dict):
                    usage_tokens = usage.get("completion_tokens")
                    record.input_len = usage.get("prompt_tokens") or record.input_len
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    if not record.token_times_s:
        record.error = "the stream carried no output"
        return
    if not done:
        record.error = "the stream ended before [DONE]"
        return
    record.ttft_s = record.token_times_s[0]
    record.e2el_s = record.token_times_s[-1]
    record.output_len = usage_tokens if usage_tokens else count_tokens("".join(text_parts))
    record.success = True


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The body's lines, ended as server-sent events end them: CR LF, LF or CR. Not
    `aiter_lines`, which splits like `str.splitlines`, also at U+2028, U+2029 and U+0085: JSON
    leaves those unescaped, so an event whose generated text held one would come apart
    mid-string."""
    pending = b""
    async for chunk in response.aiter_bytes():
        lines = (pending + chunk).splitlines(keepends=True)  # bytes split at CR and LF only
        # Keep an unended last line, and one ended by CR, whose LF may be in the next chunk.
        pending = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        for line in lines:
            yield line.rstrip(b"\r\n").decode()
    if pending:
        yield pending.rstrip(b"\r\n").decode()


def _output_piece(event: dict, endpoint: str) -> str | None:
    """The output text an event carries, or None when it carries no token."""
    choices = event.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if endpoint == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    content = delta.get("content")
    if content is None or (content == "" and "role" in delta):
        return None
    return content


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def spec_decode_counters(client: httpx.AsyncClient, target: Target) -> SpecCounters | None:
    """The server's speculative decoding counters (`vllm:spec_decode_*_total` on /metrics, as
    vLLM and bulletserve export them), summed over its labels; None where it exports none."""
    try:
        response = await client.get(
            target.base_url.rstrip("/") + "/metrics", headers=target.headers
        )
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    counters: dict[str, int] = {}
    for line in response.text.splitlines():
        for name in SPEC_COUNTERS:
            prefix = f"vllm:spec_decode_{name}_total"
            if line.startswith(prefix) and line[len(prefix) : len(prefix) + 1] in ("{", " "):
                counters[name] = counters.get(name, 0) + round(float(line.rsplit(" ", 1)[1]))
    return SpecCounters(**counters) if len(counters) == len(SPEC_COUNTERS) else None
