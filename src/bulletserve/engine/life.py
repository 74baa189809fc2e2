"""A request's life in the engine, from intake to its last output: the requests that come in
and are aborted, detokenization, stop strings and limits, outputs, the end. The executors carry
the policy's plans out and hand it what their steps sampled."""

from __future__ import annotations

import logging
import threading
from collections import deque

from transformers import PreTrainedTokenizerBase

from bulletserve.bookkeeping.book import RequestBook
from bulletserve.bookkeeping.clock import Clock
from bulletserve.engine.request import (
    FAULT,
    NO_TOKEN,
    UNSATISFIABLE,
    Request,
    RequestOutput,
    RequestState,
    TokenLogprob,
)
from bulletserve.model.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class RequestLife:
    """The requests in the engine and what becomes of them (thread-safe intake; the rest runs
    on the engine's thread or under the lanes' state lock)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        book: RequestBook[Request],
        clock: Clock,
        max_queue_delay_s: float | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.book = book
        self.clock = clock
        self.max_queue_delay_s = max_queue_delay_s
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, tuple[int, int]] = {}  # request id -> (chars, tokens) reported
        self._end_tokens: dict[str, list[int]] = {}  # a reasoning's end -> its tokens
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        # Tokens computed since start: prompts' (less what the prefix cache held) and outputs'.
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Whether whoever calls the engine's `step()` reports each hand-off of its outputs
        # (`LLMEngine.outputs_handed_off`): the server's AsyncEngine does; `LLM.generate`, which
        # uses outputs at once, does not.
        self.acks_handoff = False

    def add(self, request: Request) -> None:
        with self._lock:
            if request.request_id in self.requests:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            self.requests[request.request_id] = request
            self._inbox.append(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    @property
    def pending_intake(self) -> bool:
        """Requests or aborts not yet taken in by a step."""
        return bool(self._inbox or self._aborts)

    def take_in(self) -> list[RequestOutput]:
        """Queue the requests that came in; finish the aborted ones and those waiting past
        --max-queue-delay-ms, finish reason "shed" (their outputs)."""
        with self._lock:
            for request in self._inbox:
                self.book.enqueue(request)
            self._inbox.clear()
            aborts = list(self._aborts)
            self._aborts.clear()
        outputs = []
        for request_id in aborts:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            self._finish(request, "abort", RequestState.ABORTED)
            outputs.append(self.output(request))
        if self.max_queue_delay_s is not None:
            for request in self.book.overdue(self.clock.now(), self.max_queue_delay_s):
                self._finish(request, "shed", RequestState.ABORTED)
                outputs.append(self.output(request))
        return outputs

    def append_token(
        self, request: Request, token: int, logprob: TokenLogprob | None, now: float
    ) -> None:
        """A sampled token: detokenize, check stops and limits, finish the request if done.
        NO_TOKEN (its constraints left none) ends it with finish reason UNSATISFIABLE. A fault
        in this request's own handling (its grammar, its detokenizer) ends it alone, finish
        reason FAULT, and is logged; the engine serves on."""
        try:
            self._append_token(request, token, logprob, now)
        except Exception:
            logger.exception("request %s: its token could not be handled", request.request_id)
            if not request.is_finished:
                self._finish(request, FAULT)

    def _append_token(
        self, request: Request, token: int, logprob: TokenLogprob | None, now: float
    ) -> None:
        if token == NO_TOKEN:
            self._finish(request, UNSATISFIABLE)
            return
        params = request.params
        request.output_token_ids.append(token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        request.state = RequestState.DECODING
        self.generation_tokens += 1
        if request.timings.first_token is None:
            request.timings.first_token = now
            self.prompt_tokens += len(request.prompt_token_ids) - request.num_cached_tokens
        detok = self._detokenizers.get(request.request_id)
        if detok is None:
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            )
            self._detokenizers[request.request_id] = detok
        if request.grammar is not None and not self._advance_grammar(request, token):
            detok.flush()
            request.text = detok.text
            self._finish(request, "stop")
            return
        if token in request.stop_ids and len(request.output_token_ids) > params.min_tokens:
            detok.flush()
            request.text = detok.text
            self._finish(request, "stop")
            return
        delta = detok.add(token)
        request.text = detok.text
        if params.thinking_token_budget is not None and not request.reasoning_ended:
            self._spend_thinking(request, token, len(delta))
        if delta and params.stop:
            cut = _find_stop(request.text, params.stop, len(delta))
            if cut is not None:
                request.text = request.text[:cut]
                self._finish(request, "stop")
                return
        if (
            len(request.output_token_ids) >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            detok.flush()
            request.text = detok.text
            self._finish(request, "length")

    def _spend_thinking(self, request: Request, token: int, new_chars: int) -> None:
        """Count a reasoning token against the request's thinking_token_budget: once spent
        before the reasoning ended, the next draws are forced to its end's tokens; the
        reasoning has ended once the output ends with them."""
        params = request.params
        assert params.reasoning_end is not None and params.thinking_token_budget is not None
        end = self._end_ids(params.reasoning_end)
        if request.forced_tokens and request.forced_tokens[0] == token:
            request.forced_tokens.pop(0)
        # The end may have been written in other tokens: looked for where it could have ended
        # now, the text's last new characters (not the whole text at every token).
        tail = request.text[-(new_chars + len(params.reasoning_end)) :]
        if request.output_token_ids[-len(end) :] == end or params.reasoning_end in tail:
            request.reasoning_ended = True
            request.forced_tokens.clear()
        elif (
            not request.forced_tokens and request.num_output_tokens >= params.thinking_token_budget
        ):
            request.forced_tokens = list(end)

    def _end_ids(self, text: str) -> list[int]:
        """The tokens of a reasoning's end, as it is forced."""
        ids = self._end_tokens.get(text)
        if ids is None:
            ids = self._end_tokens[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Move the request's grammar past `token`; False where the output must end here: the
        structure is complete (its stop token accepted, which `ignore_eos` does not make a
        request stop on), or the token was outside the grammar (the sampler masks every such
        token, so this is a fault, logged)."""
        grammar = request.grammar
        assert grammar is not None
        if not grammar.accept(token):
            logger.warning(
                "request %s: token %d is outside its grammar; ending it", request.request_id, token
            )
            return False
        return not grammar.terminated

    def _finish(
        self, request: Request, reason: str, state: RequestState = RequestState.FINISHED
    ) -> None:
        request.finish_reason = reason
        request.state = state
        request.timings.finished = self.clock.now()
        self.book.finish(request)

    def output(self, request: Request) -> RequestOutput:
        """The request's output so far and what is new since the last one (a tail that could
        still grow into a stop string held back)."""
        # Built for every row at every step: each attribute read once.
        request_id, params, text = request.request_id, request.params, request.text
        token_ids = request.output_token_ids
        finished = request.is_finished
        chars, tokens = self._emitted.get(request_id, (0, 0))
        visible = len(text)
        if not finished and params.stop:
            # Hold back a tail that could still grow into a stop string.
            visible = max(chars, visible - max(len(s) for s in params.stop) + 1)
        output = RequestOutput(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text[:visible],
            token_ids=token_ids[:],
            new_text=text[chars:visible],
            new_token_ids=token_ids[tokens:],
            finished=finished,
            finish_reason=request.finish_reason,
            logprobs=request.output_logprobs[:] if params.logprobs is not None else None,
            prompt_logprobs=(
                [None, *request.prompt_logprobs] if params.prompt_logprobs is not None else None
            ),
            timings=request.timings,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
        )
        if finished:
            self._emitted.pop(request_id, None)
            self._detokenizers.pop(request_id, None)
            with self._lock:
                self.requests.pop(request_id, None)
        else:
            self._emitted[request_id] = (visible, len(token_ids))
        return output


def _find_stop(text: str, stops: list[str], delta_len: int) -> int | None:
    """Index where the earliest stop string starts, searching only where the new text could
    have completed one."""
    window_start = max(0, len(text) - delta_len - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := text.find(s, window_start)) >= 0]
    return min(hits) if hits else None
