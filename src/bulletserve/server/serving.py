"""What both generation endpoints share: checks, sampling settings, the request lifecycle."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request

from bulletserve.engine.async_engine import EngineDeadError, StreamEndedError
from bulletserve.engine.client import EngineClient
from bulletserve.engine.request import RequestOutput
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.server.errors import APIError, error_body
from bulletserve.server.metrics import ServerMetrics
from bulletserve.server.protocol import PromptTokensDetails, SamplingFields, Usage
from bulletserve.server.settings import ServerSettings

T = TypeVar("T")

# Seconds a client answered 429 is asked to wait before it retries (the Retry-After header).
RETRY_AFTER_S = 1
# A prompt over this many characters is tokenized on a worker thread, so that the event loop
# (health checks, other streams) never waits for it.
INLINE_TOKENIZE_CHARS = 4096


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def usage(output: RequestOutput) -> Usage:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


class Serving:
    """Turns a validated request into engine work and engine outputs into a request's life."""

    def __init__(self, engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics):
        self.client = engine
        self.front = engine.front
        self.tokenizer = engine.front.tokenizer
        self.settings = settings
        self.metrics = metrics
        # Requests admitted and not yet ended: counted at admission, with no await between the
        # check and the count, so that a burst cannot overshoot --max-waiting-requests.
        self._num_admitted = 0
        self._admitted_lock = threading.Lock()
        # No token is longer than its vocabulary entry (byte-level BPE spells each byte as one
        # character; others spell each character as one): a prompt of more characters than
        # this bound allows cannot fit the context, whatever it tokenizes into.
        longest_token = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.front.max_model_len * max(longest_token, 1)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    def admit(self, body: SamplingFields) -> Admission:
        """Reject what no generation can serve, before any tokenization; else the request's
        place among the admitted ones, which the caller releases if it drops the request
        before `outputs` takes it over."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model `{body.model}` does not exist", "model")
        if body.n != 1:
            raise APIError(400, f"only n=1 is supported, got n={body.n}", "n")
        if not self.client.healthy:
            raise APIError(500, f"the engine has failed: {self.client.error!r}")
        limit = self.settings.max_waiting_requests
        with self._admitted_lock:
            # Admitted requests the engine is not running: waiting in its queue, or on their
            # way to it (tokenizing, or their stream not started yet).
            waiting = self._num_admitted - self.client.num_running
            if waiting >= limit:
                raise APIError(
                    429,
                    f"the server is busy: {waiting} requests are waiting "
                    f"(--max-waiting-requests {limit}); retry later",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self._num_admitted += 1
        return Admission(self)

    def _release(self) -> None:
        with self._admitted_lock:
            self._num_admitted -= 1

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """400 for a prompt too long to fit the context whatever its tokens, before any
        tokenization (which for megabytes of text takes seconds and a gigabyte)."""
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {chars} characters, more than --max-model-len "
                f"({self.front.max_model_len}) tokens of this tokenizer can hold",
                param,
            )

    async def off_loop(self, chars: int, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` (tokenizing `chars` characters) on a worker thread where it is long,
        so that the event loop never waits for it."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return work(*args)
        return await asyncio.to_thread(work, *args)

    def sampling_params(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        """Check the prompt against the context and build the engine's settings (400 on error)."""
        try:
            self.front.check_prompt(prompt_ids)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        room = self.front.max_model_len - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.front.max_model_len} tokens, but "
                f"{len(prompt_ids) + max_tokens} were requested ({len(prompt_ids)} in the prompt "
                f"and {max_tokens} for the completion): lower max_tokens or shorten the prompt",
                "max_tokens",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else room,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None

    def outputs(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, admission: Admission
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request; the last one goes to the metrics. The
        admission ends with them, or when they are dropped unread (a stream whose client left
        before it began)."""
        outputs = self._outputs(prompt_ids, params, request_id, admission)
        weakref.finalize(outputs, admission.release)
        return outputs

    async def _outputs(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, admission: Admission
    ) -> AsyncIterator[RequestOutput]:
        last: RequestOutput | None = None
        try:
            async for output in self.client.generate(prompt_ids, params, request_id):
                last = output
                yield output
        finally:
            admission.release()
            if last is not None:
                self.metrics.observe(last)

    async def final_output(
        self, request: Request, outputs: AsyncIterator[RequestOutput]
    ) -> RequestOutput | None:
        """Run a request to the end; None (and the request aborted) if the client disconnects
        first. A failed engine is a 500."""
        work = asyncio.ensure_future(_last(outputs))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # uvicorn cancels what is still running when the shutdown timeout ends.
            raise APIError(503, "the server shut down before the request finished") from None
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # closes the engine stream, which aborts the request
                # A cancel takes effect at the task's next step: until then the task is neither
                # done nor cancelled, and asking it for its result would raise.
                await asyncio.wait({work})
        if work.cancelled():
            return None
        try:
            return work.result()
        except EngineDeadError as exc:
            raise APIError(500, str(exc)) from None
        except StreamEndedError as exc:
            raise APIError(503, str(exc)) from None

    async def stream(
        self,
        outputs: AsyncIterator[RequestOutput],
        events: Callable[[RequestOutput], list[str]],
        final_events: Callable[[RequestOutput], list[str]],
    ) -> AsyncIterator[str]:
        """Server-sent events: `events(output)` for each engine output, `final_events(last)`
        after the last one, an error event if the engine fails or the server ends the stream
        (its shutdown), and `[DONE]`."""
        try:
            last = None
            async for output in outputs:
                last = output
                for payload in events(output):
                    yield sse(payload)
            if last is not None:
                for payload in final_events(last):
                    yield sse(payload)
        except EngineDeadError as exc:
            yield sse(error_body(500, str(exc)).model_dump_json())
        except StreamEndedError as exc:
            yield sse(error_body(503, str(exc)).model_dump_json())
        except ValueError as exc:
            yield sse(error_body(400, str(exc)).model_dump_json())
        yield sse("[DONE]")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, for the `created` field."""
    return int(time.time())


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in outputs:
        last = output
    if last is None or not last.finished:
        raise EngineDeadError("the engine stream ended without a finished output")
    return last


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue


class Admission:
    """A request's place among the admitted ones (`Serving.admit`); released once, by whoever
    ends the request: its outputs' end, or the handler that drops it before them."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving
        self._held = True
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._serving._release()
