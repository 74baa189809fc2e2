"""A request's state as it moves through the engine, and what the engine reports about it (the
simulator's side of it: sim/request.py)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from bulletserve.engine.lora import LoadedAdapter
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.engine.structured import Grammar
from bulletserve.kv.allocator import salt_root
from bulletserve.sched.base import SeqView
from bulletserve.sched.slo import ServiceClass

# What the sampler gives a row whose constraints leave it no token (every logit masked: a
# grammar and allowed_token_ids with nothing in common, say); the request ends with finish
# reason "error" and the server answers 400.
NO_TOKEN = -1
# The input id of a token a step in flight is still drawing on the device (`Request.pending`):
# the executor feeds the drawn id in on the device; an id that reached the model unfed fails
# the embedding's lookup rather than computing a wrong token.
PENDING_TOKEN = -2
UNSATISFIABLE = "error"
# The finish reason of a request whose own handling failed (logged); the engine serves on.
FAULT = "fault"


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int | None = None  # the token's place among the vocabulary's by logprob (1: likeliest)


@dataclass
class RequestTimings:
    """Wall-clock times (time.monotonic seconds) of a request's milestones."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class Request:
    """Mutable engine-side state. Only the engine thread that owns the request changes it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    timings: RequestTimings
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    generator: object | None = None  # the per-request torch.Generator when a seed is given
    stop_ids: frozenset[int] = frozenset()  # token ids that end it (EOS unless ignore_eos)
    # Decoding state of its own: its place in the grammar its output must match, and the token
    # sequences of its bad words.
    grammar: Grammar | None = None
    # Tokens the next draws must give, in order (the end of a reasoning whose budget is spent),
    # and whether the output's reasoning has ended (thinking_token_budget counts until then).
    forced_tokens: list[int] = field(default_factory=list)
    reasoning_ended: bool = False
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # With `params.prompt_logprobs`: per prompt position from 1, its logprob once computed.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prefix_root: int = field(init=False, default=0)  # its prefix keys' root (its cache salt's)
    # The LoRA adapter it runs with (None: the base model); its prefix keys carry the
    # adapter's name and load generation beside the cache salt.
    lora: LoadedAdapter | None = None
    service: ServiceClass = ServiceClass()  # its priority and SLO (the server's filled in)
    # Whether its next token is being drawn by a step in flight (--async-scheduling): counted
    # in its tokens, so that the next step is planned with it, but not yet in its output.
    pending: bool = False
    # Tokens a proposer drafted to follow its output (speculative decoding), verified by its
    # next decode row: never part of its tokens until the model accepts them.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_acceptance: float = 0.0  # the chance each holds given the one before did

    def __post_init__(self) -> None:
        salt = self.params.cache_salt
        if self.lora is not None:
            salt = f"{salt or ''}\x00{self.lora.identity}"
        self.prefix_root = salt_root(salt)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * (len(self.prompt_token_ids) - 1)

    @property
    def skips_prefix_cache(self) -> bool:
        """A request for prompt logprobs computes every prompt token (a cached prefix has no
        logits)."""
        return self.params.prompt_logprobs is not None

    def prompt_targets(self, start: int, end: int) -> list[int]:
        """The prompt tokens whose logprobs a step over tokens [start, end) computes (each
        row's next token, within the prompt), for a request that asks for them."""
        if self.params.prompt_logprobs is None:
            return []
        return self.prompt_token_ids[start + 1 : min(end + 1, len(self.prompt_token_ids))]

    def keep_prompt_logprobs(self, start: int, logprobs: list[TokenLogprob]) -> None:
        """Keep the logprobs of prompt positions start + 1, start + 2, ... (a step's over
        tokens from `start`; a recomputation after preemption writes the same again)."""
        self.prompt_logprobs[start : start + len(logprobs)] = logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.pending

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (a pending token as PENDING_TOKEN)."""
        if self.pending and start < end == self.num_tokens:
            return [*self.token_ids(start, end - 1), PENDING_TOKEN]
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:  # a decode step: no copy of the whole sequence
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def priority(self) -> int:
        return self.service.priority

    def view(self) -> SeqView:
        """The request as a policy sees it."""
        return SeqView(
            self.request_id,
            self.timings.arrival,
            self.num_tokens,
            self.num_computed_tokens,
            len(self.block_table),
            priority=self.service.priority,
            slo=self.service.slo,
            first_token_time=self.timings.first_token,
            num_output_tokens=self.num_output_tokens,
            num_draft_tokens=len(self.draft_token_ids),
            draft_acceptance=self.draft_acceptance,
            lora=None if self.lora is None else self.lora.identity,
        )


@dataclass
class CompletionOutput:
    """One generated sequence of a prompt, as vLLM's `RequestOutput.outputs[i]`."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of its tokens' logprobs, where they were asked for."""
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs is not None else None


@dataclass
class RequestOutput:
    """A snapshot of a request after a step: the whole output so far and what is new in it.
    `outputs` is vLLM's shape of the same: the prompt's sequences (this request's alone, built
    on access, off the per-step path; `LLM.generate` gathers a prompt's n into `sequences`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    timings: RequestTimings
    # With prompt_logprobs: per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    sequences: list[CompletionOutput] | None = None  # a prompt's n, where gathered

    def then(self, later: RequestOutput) -> RequestOutput:
        """`later` with what was new in this output too: two consecutive outputs of a request
        as one (every other field of `later` is already cumulative)."""
        return dataclasses.replace(
            later,
            new_text=self.new_text + later.new_text,
            new_token_ids=self.new_token_ids + later.new_token_ids,
        )

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self.sequences is not None:
            return self.sequences
        return [CompletionOutput(0, self.text, self.token_ids, self.logprobs, self.finish_reason)]
