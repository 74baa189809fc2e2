"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular
expression, one of a list of choices, or an EBNF grammar, through xgrammar (the grammar engine
vLLM and SGLang use).

A `StructuredOutputs` is the request's wish, plain data. `GrammarCompiler` (one per tokenizer,
in `ModelFront`) checks it against the bounds (`grammar_limits.py`: its size, its schema's shape,
keywords xgrammar would ignore), compiles it in a compiler process (`grammar_pool.py`: a
deadline, and a compile whose requesters all left is stopped) and keeps the compiled grammars
in a cache bounded in bytes, so the server compiles before the engine sees the request and the
engine's own compile is a cache hit. Each request gets a `GrammarState` (xgrammar's matcher)
that the sampler asks for the tokens allowed next and the engine advances with every token it
appends; preemption keeps a request's output tokens, so the matcher never has to go back.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from bulletserve.engine.grammar_limits import (
    GrammarLimitError,
    GrammarLimits,
    check_schema,
    check_size,
)
from bulletserve.engine.grammar_pool import CompileFailed, CompileJob, CompilePool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

StructureKind = Literal["json", "json_object", "regex", "choice", "grammar"]


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled or is past a bound (a 400 at the
    API)."""


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match: exactly one of the kinds (vLLM's `structured_outputs`)."""

    kind: StructureKind
    spec: str = ""  # the JSON schema (serialized), the regex, or the EBNF grammar; "" otherwise
    choices: tuple[str, ...] = ()

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        except RecursionError:
            raise GrammarError("the schema nests too deep") from None
        return cls("json", text)

    def __post_init__(self) -> None:
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise GrammarError("choice needs a non-empty list of non-empty strings")
        elif self.kind in ("json", "regex", "grammar") and not self.spec:
            raise GrammarError(f"structured output {self.kind!r} needs a non-empty spec")

    @property
    def size(self) -> int:
        """Its bytes: the spec's, or the choices' (with a separator each)."""
        if self.kind == "choice":
            return sum(len(c.encode()) + 1 for c in self.choices)
        return len(self.spec.encode())


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer and vocabulary (the model's logits width),
    with the model's stop tokens as what ends a complete structure, within `limits`. xgrammar
    is imported and the compiler processes started on first use (a few seconds), so servers
    that never see a structured request never pay for them."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_ids: frozenset[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self.limits = limits or GrammarLimits()
        self._info: Any = None
        self._pool: CompilePool | None = None
        self._closed = False
        self._lock = threading.Lock()  # the cache's
        self._start_lock = threading.Lock()  # the compiler processes' start (seconds)
        # structure -> (its compiled grammar, that grammar's bytes), least recently used first
        self._cache: OrderedDict[StructuredOutputs, tuple[Any, int]] = OrderedDict()
        self.cache_bytes = 0

    def check(self, structure: StructuredOutputs) -> None:
        """GrammarError where `structure` is past a bound or asks what cannot be enforced
        (before anything is compiled)."""
        try:
            check_size(_NAMES[structure.kind], structure.size, self.limits)
            if structure.kind == "json":
                try:
                    schema = json.loads(structure.spec)
                except (json.JSONDecodeError, RecursionError) as exc:
                    raise GrammarError(f"the schema is not JSON ({exc})") from None
                check_schema(schema)
        except GrammarLimitError as exc:
            raise GrammarError(str(exc)) from None

    def compile(self, structure: StructuredOutputs) -> Any:
        """xgrammar's compiled grammar for `structure` (cached), waiting for the compiler on
        this thread; GrammarError if it is invalid, past a bound or does not compile in time.
        A cached grammar passed `check` when it was compiled."""
        compiled = self._cached(structure)
        if compiled is not None:
            return compiled
        self.check(structure)
        pool, job = self._submit(structure)
        try:
            reply = job.result.result()
        except CompileFailed as exc:
            raise _not_compiled(structure, exc) from None
        finally:
            pool.leave(job)
        return self._store(structure, reply)

    async def compile_async(self, structure: StructuredOutputs) -> Any:
        """As `compile`, for the event loop: nothing heavy runs on it, and a requester that is
        cancelled (its client left) stops waiting at once, the compile ended where no one else
        waits for it."""
        compiled = self._cached(structure)
        if compiled is not None:
            return compiled
        self.check(structure)
        submitting = asyncio.ensure_future(asyncio.to_thread(self._submit, structure))
        try:
            pool, job = await asyncio.shield(submitting)
        except asyncio.CancelledError:
            submitting.add_done_callback(_leave_when_submitted)
            raise
        try:
            reply = await _settled(job.result)
        except CompileFailed as exc:
            raise _not_compiled(structure, exc) from None
        finally:
            pool.leave(job)
        return await asyncio.to_thread(self._store, structure, reply)

    def state(self, structure: StructuredOutputs) -> GrammarState:
        return GrammarState(self.compile(structure))

    def close(self) -> None:
        """Stop the compiler processes; compiles in flight fail."""
        with self._start_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _cached(self, structure: StructuredOutputs) -> Any:
        with self._lock:
            entry = self._cache.get(structure)
            if entry is None:
                return None
            self._cache.move_to_end(structure)
            return entry[0]

    def _store(self, structure: StructuredOutputs, reply: dict[str, str]) -> Any:
        if "error" in reply:
            raise GrammarError(f"invalid {structure.kind} for structured output: {reply['error']}")
        import xgrammar

        compiled = xgrammar.CompiledGrammar.deserialize_json(reply["compiled"], self._info)
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if structure not in self._cache and size <= self.limits.cache_bytes:
                self._cache[structure] = (compiled, size)
                self.cache_bytes += size
                while self.cache_bytes > self.limits.cache_bytes:
                    _, (_, evicted_size) = self._cache.popitem(last=False)
                    self.cache_bytes -= evicted_size
        return compiled

    def _submit(self, structure: StructuredOutputs) -> tuple[CompilePool, CompileJob]:
        message = {"kind": structure.kind, "spec": structure.spec, "choices": structure.choices}
        pool = self._pool_or_start()
        try:
            return pool, pool.submit(structure, message, self.limits.compile_timeout_s)
        except CompileFailed as exc:
            raise _not_compiled(structure, exc) from None

    def _pool_or_start(self) -> CompilePool:
        with self._start_lock:
            if self._closed:
                raise GrammarError("the server is shutting down: no grammar is compiled")
            if self._pool is None:
                import xgrammar

                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                self._pool = CompilePool(self._info.serialize_json(), self.limits.compile_workers)
            return self._pool


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def _not_compiled(structure: StructuredOutputs, exc: CompileFailed) -> GrammarError:
    name = _NAMES[structure.kind]
    return GrammarError(f"the {name} for structured output was not compiled: {exc}")


def _leave_when_submitted(submitting: asyncio.Future) -> None:
    """Its requester was cancelled while the job was being submitted: it leaves the job."""
    if not submitting.cancelled() and submitting.exception() is None:
        pool, job = submitting.result()
        pool.leave(job)


async def _settled(result: Future) -> Any:
    """`result`'s value, awaited without tying its fate to the awaiting task: cancelling the
    task leaves `result` alone (other requesters may share it)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[Any] = loop.create_future()

    def copy(done: Future) -> None:
        if waiter.done():
            return
        error = done.exception()
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    def settle(done: Future) -> None:
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    result.add_done_callback(settle)
    return await waiter


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The structure is complete and its stop token accepted: nothing more may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (allocate_bitmask's)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_text(self, text: str) -> bool:
        """Advance past `text` (what part of a token the grammar starts at); False if the
        grammar does not allow it."""
        return bool(self._matcher.accept_string(text))


class GrammarAfter:
    """A grammar that holds the output only after `marker` (a reasoning model's `</think>`:
    the reasoning is free text, the answer is held to the structure, as vLLM enforces it).
    Until the output's text holds the marker every token is allowed; then the grammar takes
    the text after the marker in the token that completed it (its leading whitespace left out,
    as between a tag and an answer), and from there masks and accepts as `GrammarState` does."""

    # Tokens of recent output decoded to find the marker (it spans a few tokens at most).
    WINDOW = 32

    def __init__(
        self, grammar: GrammarState, marker: str, decode: Callable[[list[int]], str]
    ) -> None:
        self._grammar = grammar
        self._marker = marker
        self._decode = decode
        self._ids: list[int] = []
        self.started = False

    def accept(self, token: int) -> bool:
        if self.started:
            return self._grammar.accept(token)
        self._ids = self._ids[-self.WINDOW :] + [token]
        _, found, rest = self._decode(self._ids).partition(self._marker)
        if not found:
            return True
        self.started = True
        rest = rest.lstrip()
        return self._grammar.accept_text(rest) if rest else True

    @property
    def terminated(self) -> bool:
        return self.started and self._grammar.terminated

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self._grammar.fill(bitmask, row)
        else:
            bitmask[row].fill_(-1)  # every bit: any token


# A request's grammar state: from its first token, or after a marker.
Grammar = GrammarState | GrammarAfter


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(vocab / 32)] bitmask, bit j of word w allowing token 32 w + j."""
    return torch.zeros(rows, -(-vocab_size // 32), dtype=torch.int32)


_BITS = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int32)


def disallowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool [rows, vocab_size] tensor, True where the bitmask does not allow the token."""
    bits = bitmask.unsqueeze(-1).bitwise_and(_BITS.to(bitmask.device)).eq(0)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]
