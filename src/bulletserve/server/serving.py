"""What both generation endpoints share: checks, sampling settings, the request lifecycle."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from bulletserve.engine.async_engine import EngineDeadError, StreamEndedError
from bulletserve.engine.client import EngineClient
from bulletserve.engine.request import FAULT, UNSATISFIABLE, RequestOutput, TokenLogprob
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.engine.structured import GrammarError, StructuredOutputs
from bulletserve.sched.base import check_priority
from bulletserve.sched.slo import SLO, ServiceClass
from bulletserve.server.fields import check_fields, logit_bias_of, structure_of
from bulletserve.server.http_errors import APIError, error_body, logged_error
from bulletserve.server.metrics import ServerMetrics
from bulletserve.server.protocol import (
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from bulletserve.server.settings import ServerSettings

T = TypeVar("T")

# Seconds a client answered 429 is asked to wait before it retries (the Retry-After header).
RETRY_AFTER_S = 1
# A prompt over this many characters is tokenized on a worker thread, so that the event loop
# (health checks, other streams) never waits for it.
INLINE_TOKENIZE_CHARS = 4096

logger = logging.getLogger(__name__)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def usage(outputs: list[RequestOutput], per_prompt: int | None = None) -> Usage:
    """Usage of a request's choices in index order, each run of `per_prompt` of them (None: all)
    one prompt's: each prompt counted once, with the cached tokens its first choice found, and
    every choice's completion."""
    per_prompt = per_prompt or len(outputs)
    firsts = outputs[::per_prompt]
    prompt = sum(len(out.prompt_token_ids) for out in firsts)
    completion = sum(len(out.token_ids) for out in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(out.num_cached_tokens for out in firsts)
        ),
    )


class Serving:
    """Turns a validated request into engine work and engine outputs into a request's life."""

    def __init__(self, engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics):
        self.client = engine
        self.front = engine.front
        self.tokenizer = engine.front.tokenizer
        self.settings = settings
        self.metrics = metrics
        # The LoRA adapters served, by name (their paths): those of the start, and those
        # loaded and unloaded at run time since.
        self.adapters = dict(settings.lora_modules)
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

    def admit(self, body: SamplingFields, sequences: int = 1) -> Admission:
        """Reject what no generation can serve, before any tokenization; else the places of the
        request's `sequences` among the admitted ones, which the caller releases if it drops
        the request before `outputs` takes them over."""
        if body.model not in (None, self.model_name) and body.model not in self.adapters:
            raise APIError(404, f"the model `{body.model}` does not exist", "model")
        check_fields(body)
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
            self._num_admitted += sequences
        return Admission(self, sequences)

    def adapter(self, body: SamplingFields) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base model)."""
        return body.model if body.model in self.adapters else None

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` from now on (400 naming what is wrong)."""
        self._check_runtime_updates()
        if name in (self.model_name, *self.adapters):
            raise APIError(400, f"the LoRA adapter {name!r} has already been loaded", "lora_name")
        try:
            await self.client.load_lora_adapter(name, path)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        """Serve the adapter `name` no more (404 where none has the name)."""
        self._check_runtime_updates()
        if name not in self.adapters:
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found", "lora_name")
        del self.adapters[name]
        await self.client.unload_lora_adapter(name)

    def _check_runtime_updates(self) -> None:
        if not self.settings.runtime_lora_updates:
            raise APIError(
                400,
                "loading and unloading LoRA adapters at run time is off: start the server with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (and --enable-lora)",
            )

    def service(self, body: SamplingFields) -> ServiceClass:
        """The request's priority and SLO: its `slo` class (one the server was started with) or
        targets of its own; a 400 naming the field where they cannot be served."""
        priority = body.priority
        try:
            check_priority(priority, self.settings.scheduling_policy)
        except ValueError as exc:
            raise APIError(400, str(exc), "priority") from None
        if body.slo is None or body.slo == "default":
            return ServiceClass(priority)
        if isinstance(body.slo, str):
            slo = self.settings.slo_classes.get(body.slo)
            if slo is None:
                known = ", ".join(sorted(self.settings.slo_classes)) or "default"
                raise APIError(
                    400, f"slo: unknown class {body.slo!r}; this server has {known}", "slo"
                )
            return ServiceClass(priority, slo, body.slo)
        targets = body.slo
        slo = SLO(targets.ttft_per_token_ms, targets.tpot_ms, targets.ttft_base_ms)
        return ServiceClass(priority, slo, "custom")

    def _release(self, count: int) -> None:
        with self._admitted_lock:
            self._num_admitted -= count

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

    async def structure(self, body: SamplingFields, request: Request) -> StructuredOutputs | None:
        """The structured output the request asks for, compiled (in a compiler process; cached
        by spec, so the engine's own compile finds it): a 400 naming the field if it cannot be
        (past a bound, a keyword not enforced, past the compile deadline). A client that leaves
        meanwhile stops waiting at once (499), its compile ended where no one else waits."""
        structure, field = structure_of(body)
        if structure is None:
            return None
        compiled = asyncio.ensure_future(self.front.grammars.compile_async(structure))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({compiled, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not compiled.done():
                compiled.cancel()
                await asyncio.wait({compiled})
        if compiled.cancelled():
            raise APIError(499, "the client left before its grammar was compiled")
        try:
            compiled.result()
        except GrammarError as exc:
            raise APIError(400, str(exc), field) from None
        return structure

    async def response(self, logprobs: bool, build: Callable[[], T]) -> T:
        """`build()`, a finished request's response: on a worker thread where it carries
        logprobs (per token up to 20 decoded alternatives: thousands of decodes would hold the
        event loop)."""
        return await asyncio.to_thread(build) if logprobs else build()

    def truncated(self, body: SamplingFields, prompt_ids: list[int]) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens, where the request asks so."""
        keep = body.truncate_prompt_tokens
        return prompt_ids[-keep:] if keep is not None else prompt_ids

    def sampling_params(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        structure: StructuredOutputs | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Check the prompt against the context and build the engine's settings (400 on error).
        `prompt_logprobs`: the body's, unless the endpoint asks for more."""
        try:
            self.front.check_prompt(prompt_ids)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        room = self.front.max_model_len - len(prompt_ids)
        defaults = self.front.sampling_defaults
        if max_tokens is None and "max_tokens" in defaults.values:
            max_tokens = min(int(defaults.values["max_tokens"]), room)
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.front.max_model_len} tokens, but "
                f"{len(prompt_ids) + max_tokens} were requested ({len(prompt_ids)} in the prompt "
                f"and {max_tokens} for the completion): lower max_tokens or shorten the prompt",
                "max_tokens",
            )
        try:
            params = SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else room,
                temperature=defaults.get("temperature", body.temperature, 1.0),
                top_p=defaults.get("top_p", body.top_p, 1.0),
                top_k=int(defaults.get("top_k", body.top_k, 0)),
                seed=body.seed,
                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=(
                    body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
                ),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=defaults.get("repetition_penalty", body.repetition_penalty, 1.0),
                min_p=defaults.get("min_p", body.min_p, 0.0),
                logit_bias=logit_bias_of(body),
                stop_token_ids=list(body.stop_token_ids or []),
                bad_words=list(body.bad_words or []),
                allowed_token_ids=body.allowed_token_ids,
                structured_outputs=structure,
                cache_salt=body.cache_salt,
                skip_special_tokens=body.skip_special_tokens,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None
        try:
            self.front.check_sampling(params)
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None
        return params

    def prompt_logprobs(
        self, entries: list[TokenLogprob | None] | None, top: int | None
    ) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per prompt token but the first, the token itself and its
        `top` likeliest alternatives, each with its logprob, rank and text (None where the
        request asked for none)."""
        if entries is None or top is None:
            return None
        decode = self.tokenizer.decode
        result: PromptLogprobs = [None]
        for entry in entries[1:]:
            assert entry is not None  # the prompt was computed before its first token came
            ranked = [(entry.token_id, entry.logprob, entry.rank or 0)]
            ranked += [(t, lp, rank) for rank, (t, lp) in enumerate(entry.top[:top], start=1)]
            position: dict[int, PromptLogprob] = {}
            for token_id, logprob, rank in ranked:
                if token_id not in position:
                    position[token_id] = PromptLogprob(
                        logprob=logprob, rank=rank, decoded_token=decode([token_id])
                    )
            result.append(position)
        return result

    def outputs(
        self, choices: list[ChoiceWork], request_id: str, admission: Admission
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The engine's outputs for a request's choices, as (choice index, output), merged in
        the order they come; each choice's last output goes to the metrics. The admission ends
        with them, or when they are dropped unread (a stream whose client left before it
        began)."""
        outputs = self._merged(choices, request_id, admission)
        weakref.finalize(outputs, admission.release)
        return outputs

    async def _merged(
        self, choices: list[ChoiceWork], request_id: str, admission: Admission
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Each prompt's first choice starts at once; its other choices start when it has its
        first output, its prompt's KV blocks cached by then, so they share them through the
        prefix cache instead of computing the prompt again."""
        if len(choices) == 1:
            choice = choices[0]
            async for output in self._outputs(choice, request_id, admission):
                yield choice.index, output
            return
        items: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []

        async def run(choice: ChoiceWork, then: list[ChoiceWork]) -> None:
            try:
                async for output in self._outputs(
                    choice, f"{request_id}-{choice.index}", admission
                ):
                    if then:
                        tasks.extend(asyncio.ensure_future(run(c, [])) for c in then)
                        then = []
                    items.put_nowait((choice.index, output))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                items.put_nowait(exc)
            finally:
                for _ in range(1 + len(then)):  # this choice, and siblings it never started
                    items.put_nowait(None)

        groups: dict[int, list[ChoiceWork]] = {}
        for choice in choices:
            groups.setdefault(choice.prompt_index, []).append(choice)
        tasks.extend(asyncio.ensure_future(run(g[0], g[1:])) for g in groups.values())
        ended = 0
        try:
            while ended < len(choices):
                item = await items.get()
                if item is None:
                    ended += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # closes its engine stream, which aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _outputs(
        self, choice: ChoiceWork, request_id: str, admission: Admission
    ) -> AsyncIterator[RequestOutput]:
        last: RequestOutput | None = None
        if self.settings.log_requests:
            logger.info(
                "request %s: %d prompt tokens, %s%s",
                request_id,
                len(choice.prompt_ids),
                choice.params.summary(),
                "" if choice.lora is None else f", LoRA adapter {choice.lora}",
            )
        try:
            outputs = self.client.generate(
                choice.prompt_ids, choice.params, request_id, None, choice.service, choice.lora
            )
            async for output in outputs:
                last = output
                if output.finish_reason == "shed":
                    raise RequestShedError(
                        "the server is past its capacity: the request waited more than "
                        "--max-queue-delay-ms for its first step; retry later"
                    )
                if output.finish_reason == FAULT:
                    raise RequestFaultError(
                        f"request {request_id}: its handling in the engine failed"
                    )
                if output.finish_reason == UNSATISFIABLE:
                    raise UnsatisfiableError(
                        "the request's constraints leave no token it may generate (its "
                        "structured output, allowed_token_ids, bad_words or logit_bias have "
                        f"nothing in common after {len(output.token_ids)} tokens)"
                    )
                yield output
        finally:
            admission.release(1)
            if last is not None:
                self.metrics.observe(last, choice.service)
            if self.settings.log_requests:
                ended = last.finish_reason if last is not None and last.finished else "aborted"
                tokens = len(last.token_ids) if last is not None else 0
                logger.info("request %s: %s after %d tokens", request_id, ended, tokens)

    async def final_outputs(
        self, request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> dict[int, RequestOutput] | None:
        """Run a request's choices to the end: each choice's last output by its index; None
        (and the requests aborted) if the client disconnects first. A failed engine is a 500."""
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
                work.cancel()  # closes the engine streams, which aborts the requests
                # A cancel takes effect at the task's next step: until then the task is neither
                # done nor cancelled, and asking it for its result would raise.
                await asyncio.wait({work})
        if work.cancelled():
            return None
        try:
            return work.result()
        except EngineDeadError as exc:
            raise APIError(500, logged_error("the engine failed", exc)) from None
        except RequestFaultError as exc:
            raise APIError(500, logged_error("the request failed in the engine", exc)) from None
        except StreamEndedError as exc:
            raise APIError(503, str(exc)) from None
        except RequestShedError as exc:
            raise APIError(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except UnsatisfiableError as exc:
            raise APIError(400, str(exc)) from None

    async def stream(
        self,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        events: Callable[[int, RequestOutput], list[str]],
        final_events: Callable[[list[RequestOutput]], list[str]],
    ) -> AsyncIterator[str]:
        """Server-sent events: `events(index, output)` for each engine output of each choice,
        `final_events(lasts)` after the last one, an error event if the engine fails or the
        server ends the stream (its shutdown), and `[DONE]`."""
        try:
            last: dict[int, RequestOutput] = {}
            async for index, output in outputs:
                first = index not in last
                last[index] = output
                if first and output.prompt_logprobs is not None:
                    # A choice's first chunk with the prompt's logprobs (echo): thousands of
                    # decodes, formatted on a worker thread rather than on the event loop.
                    payloads = await asyncio.to_thread(events, index, output)
                else:
                    payloads = events(index, output)
                for payload in payloads:
                    yield sse(payload)
            if last:
                for payload in final_events([last[i] for i in sorted(last)]):
                    yield sse(payload)
        except EngineDeadError as exc:
            yield sse(error_body(500, logged_error("the engine failed", exc)).model_dump_json())
        except RequestFaultError as exc:
            message = logged_error("the request failed in the engine", exc)
            yield sse(error_body(500, message).model_dump_json())
        except StreamEndedError as exc:
            yield sse(error_body(503, str(exc)).model_dump_json())
        except RequestShedError as exc:
            yield sse(error_body(429, str(exc)).model_dump_json())
        except ValueError as exc:
            yield sse(error_body(400, str(exc)).model_dump_json())
        yield sse("[DONE]")


class RequestShedError(Exception):
    """The engine shed the request before its first step (--max-queue-delay-ms)."""


class RequestFaultError(RuntimeError):
    """The engine's handling of this request alone failed (its traceback in the server log);
    the engine serves on."""


class UnsatisfiableError(ValueError):
    """The request's constraints left no token to generate (a 400; streamed, an error
    event)."""


@dataclass
class ChoiceWork:
    """One sequence a request asks for: choice `index` of the prompt at `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    service: ServiceClass = ServiceClass()
    lora: str | None = None  # the LoRA adapter's name (None: the base model)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, for the `created` field."""
    return int(time.time())


async def _last(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    last: dict[int, RequestOutput] = {}
    async for index, output in outputs:
        last[index] = output
    if not last or not all(output.finished for output in last.values()):
        raise EngineDeadError("the engine stream ended without a finished output")
    return last


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue


class Admission:
    """A request's place among the admitted ones (`Serving.admit`); released once, by whoever
    ends the request: its outputs' end, or the handler that drops it before them."""

    def __init__(self, serving: Serving, count: int = 1) -> None:
        self._serving = serving
        self._held = count
        self._lock = threading.Lock()

    def release(self, count: int | None = None) -> None:
        """Release `count` of the places (None: all that are held)."""
        with self._lock:
            taken = self._held if count is None else min(count, self._held)
            self._held -= taken
        if taken:
            self._serving._release(taken)
