"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from bulletserve.engine.structured import StructuredOutputs


@dataclass
class SamplingParams:
    """What to generate and when to stop; names follow vLLM and OpenAI.

    temperature 0 means greedy. `seed` makes one request's sampling reproducible whatever else
    runs beside it.
    """

    n: int = 1  # sequences per prompt (LLM.generate and the server run one request each)
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per token, or None for none
    # Per prompt token after the first: its logprob given the tokens before it, its rank and
    # this many most likely alternatives (vLLM's prompt_logprobs); None: none.
    prompt_logprobs: int | None = None
    # Penalties, as OpenAI and vLLM define them: presence and frequency over the output's
    # tokens, repetition (1: none) over the prompt's and the output's.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    bad_words: list[str] = field(default_factory=list)  # never generated (vLLM's bad_words)
    allowed_token_ids: list[int] | None = None  # None: any token; else only these
    structured_outputs: StructuredOutputs | None = None  # what the output must match
    # The text that ends a reasoning model's reasoning (`</think>`, set by a reasoning parser):
    # structured_outputs holds only the output after it, and thinking_token_budget counts the
    # tokens before it.
    reasoning_end: str | None = None
    # At most this many tokens of reasoning (vLLM's field): spent, the reasoning's end is forced.
    thinking_token_budget: int | None = None
    # Whether the output's text leaves special tokens out (vLLM's; False keeps a tool-call
    # marker that is one, Mistral's `[TOOL_CALLS]`).
    skip_special_tokens: bool = True
    # Not a sampling setting but the request's too: only requests with the same salt share
    # cached prompt blocks (vLLM's cache_salt), so a client cannot learn from the cache's
    # speed or `cached_tokens` what another sent.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 for no limit), got {self.top_k}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (self.cache_salt is None or self.cache_salt != "", "cache_salt must not be empty"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0 < self.repetition_penalty <= 2,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.logit_bias),
                "logit_bias keys must be token ids (integers >= 0)",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be token ids (integers >= 0)",
            ),
            (all(isinstance(w, str) and w for w in self.bad_words), "bad words must be non-empty"),
            (
                self.allowed_token_ids is None
                or (
                    bool(self.allowed_token_ids)
                    and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)
                ),
                "allowed_token_ids must be a non-empty list of token ids",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def summary(self) -> str:
        """The settings that differ from the defaults, as `name=value` pairs (a request log's)."""
        changed = []
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            if getattr(self, f.name) != default:
                changed.append(f"{f.name}={getattr(self, f.name)!r}")
        return ", ".join(changed) or "defaults"

    def for_choice(self, k: int) -> SamplingParams:
        """The settings of a prompt's k-th sequence, one engine request: a seeded request's
        sequences draw from seed + k, as vLLM's parallel sampling does, so that they differ and
        each is reproducible; only the first computes the prompt's logprobs (the same for
        every sequence; the others then share its cached prompt)."""
        if k == 0:
            return dataclasses.replace(self, n=1) if self.n != 1 else self
        seed = None if self.seed is None else self.seed + k
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=None)


# What a model's generation_config.json may set that a request can leave out (vLLM's list).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """A request's sampling settings where it leaves them out: the model creator's, read from
    its generation_config.json (`--generation-config`), else ours (`SamplingParams`)."""

    values: dict[str, float | int] = field(default_factory=dict)

    @classmethod
    def from_file(cls, path: Path) -> SamplingDefaults:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--generation-config: cannot read {path}: {exc}") from None
        values = {
            ours: data[theirs]
            for theirs, ours in GENERATION_CONFIG_FIELDS.items()
            if isinstance(data.get(theirs), int | float) and not isinstance(data[theirs], bool)
        }
        return cls(values)

    def get(self, name: str, given: float | int | None, fallback: float | int) -> float | int:
        """`given` if the request set it, else the model's default, else `fallback`."""
        if given is not None:
            return given
        return self.values.get(name, fallback)
