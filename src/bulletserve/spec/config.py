"""`--speculative-config` (vLLM's keys): which proposer drafts and how many tokens a step."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

SpecMethod = Literal["ngram"]
METHODS: tuple[SpecMethod, ...] = ("ngram",)
# vLLM's other methods, not built here: what each needs.
NOT_BUILT = {
    "suffix": "suffix decoding is not built yet; use ngram",
    "draft_model": "a draft model is not built yet; use ngram",
    "eagle": "EAGLE needs a trained draft head over the target's hidden states, not built here",
    "eagle3": "EAGLE-3 needs a trained draft head over the target's hidden states, not built here",
    "mtp": "MTP needs the model's own multi-token-prediction layers, which no model here loads",
    "medusa": "Medusa needs trained prediction heads, not built here",
    "mlp_speculator": "an MLP speculator needs a trained draft head, not built here",
}
# vLLM's default n-gram window where neither bound is given.
DEFAULT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 64
MAX_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Drafts of up to `num_speculative_tokens` tokens per decoding request and step; for
    ngram, the longest n-gram from `prompt_lookup_max` down to `prompt_lookup_min` that ends
    the request's tokens and occurred in them before proposes what followed it there.
    `adaptive` (ours, not vLLM's): a step verifies only the drafts worth what they cost, priced
    by the performance model (`sched.drafts`); false verifies every draft, as vLLM does."""

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    adaptive: bool = True

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From --speculative-config's JSON or `LLM(speculative_config={...})`; ValueError
        naming the key that is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        method = value.get("method")
        if method in NOT_BUILT:
            raise ValueError(f"--speculative-config method {method!r}: {NOT_BUILT[method]}")
        if method not in METHODS:
            names = ", ".join(METHODS)
            raise ValueError(f"--speculative-config method must be one of {names}, not {method!r}")
        if unknown:
            raise ValueError(
                f"--speculative-config key {unknown[0]!r} is not taken with method {method!r} "
                f"(taken: {', '.join(sorted(known))})"
            )
        tokens = _count("num_speculative_tokens", value.get("num_speculative_tokens"))
        # vLLM's: a bound not given is the other's, and both 5 where neither is.
        low = value.get("prompt_lookup_min")
        high = value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        low = _count("prompt_lookup_min", high if low is None else low, MAX_LOOKUP)
        high = _count("prompt_lookup_max", low if high is None else high, MAX_LOOKUP)
        if low > high:
            raise ValueError(
                f"--speculative-config prompt_lookup_min ({low}) is above prompt_lookup_max "
                f"({high})"
            )
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(
                f"--speculative-config adaptive must be true or false, not {adaptive!r}"
            )
        return cls(method, tokens, low, high, adaptive)

    def describe(self) -> str:
        """The startup block's line."""
        verified = (
            "the drafts worth their cost verified" if self.adaptive else "every draft verified"
        )
        return (
            f"{self.method}, {self.num_speculative_tokens} tokens a step, n-grams of "
            f"{self.prompt_lookup_min}-{self.prompt_lookup_max}, {verified}"
        )


def _count(key: str, number: Any, most: int = MAX_SPECULATIVE_TOKENS) -> int:
    """`number` as the setting `key`: an integer in [1, most]; ValueError naming it."""
    if number is None:
        raise ValueError(f"--speculative-config needs {key!r}")
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= most:
        raise ValueError(
            f"--speculative-config {key} must be an integer in [1, {most}], not {number!r}"
        )
    return number
