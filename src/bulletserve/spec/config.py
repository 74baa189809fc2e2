"""`--speculative-config` (vLLM's keys): which proposer drafts and how many tokens a step."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from bulletserve.model.source import check_quantization

SpecMethod = Literal["ngram", "suffix", "draft_model"]
METHODS: tuple[SpecMethod, ...] = ("ngram", "suffix", "draft_model")
# vLLM's other methods, not built here: what each needs.
NOT_BUILT = {
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
MAX_TREE_DEPTH = 256
# The keys each method takes beside method, num_speculative_tokens and adaptive.
METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
    "draft_model": ("model", "draft_tensor_parallel_size", "quantization"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Drafts of up to `num_speculative_tokens` tokens per decoding request and step; for
    ngram, the longest n-gram from `prompt_lookup_max` down to `prompt_lookup_min` that ends
    the request's tokens and occurred in them before proposes what followed it there; for
    suffix, a trie of continuations up to `suffix_decoding_max_tree_depth` tokens over the
    request's tokens and the last `suffix_decoding_max_cached_requests` outputs, followed while
    each token's share is at least `suffix_decoding_min_token_prob`, for up to
    `suffix_decoding_max_spec_factor` x the match's length (spec/suffix.py; vLLM's defaults).
    For draft_model, `model` (a folder, a cached Hugging Face id or a GGUF file, of the
    target's tokenizer) drafts on its own weights and KV cache, unsharded
    (`draft_tensor_parallel_size` 1), its weights as `quantization` says (as --quantization).
    `adaptive` (ours, not vLLM's): a step verifies only the drafts worth what they cost, priced
    by the performance model (`sched.drafts`); false verifies every draft, as vLLM does."""

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    adaptive: bool = True
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    quantization: str | None = None

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
        method = value.get("method")
        if method is None and "model" in value:
            method = "draft_model"  # vLLM's: a model without a method drafts as one
        if method in NOT_BUILT:
            raise ValueError(f"--speculative-config method {method!r}: {NOT_BUILT[method]}")
        if method not in METHODS:
            names = ", ".join(METHODS)
            raise ValueError(f"--speculative-config method must be one of {names}, not {method!r}")
        known = {"method", "num_speculative_tokens", "adaptive", *METHOD_KEYS[method]}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config key {unknown[0]!r} is not taken with method {method!r} "
                f"(taken: {', '.join(sorted(known))})"
            )
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(
                f"--speculative-config adaptive must be true or false, not {adaptive!r}"
            )
        if method == "suffix":
            return cls._suffix(value, adaptive)
        if method == "draft_model":
            return cls._draft_model(value, adaptive)
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
        return cls(method, tokens, low, high, adaptive)

    @classmethod
    def _suffix(cls, value: dict[str, Any], adaptive: bool) -> SpeculativeConfig:
        depth = _count(
            "suffix_decoding_max_tree_depth",
            value.get("suffix_decoding_max_tree_depth", 24),
            MAX_TREE_DEPTH,
        )
        # vLLM's: as many tokens a step as the tree is deep, where not given.
        tokens = _count("num_speculative_tokens", value.get("num_speculative_tokens", depth))
        cached = value.get("suffix_decoding_max_cached_requests", 10000)
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError(
                "--speculative-config suffix_decoding_max_cached_requests must be an integer "
                f">= 0, not {cached!r}"
            )
        factor = value.get("suffix_decoding_max_spec_factor", 1.0)
        if not _number(factor) or not factor > 0:
            raise ValueError(
                f"--speculative-config suffix_decoding_max_spec_factor must be > 0, not {factor!r}"
            )
        least = value.get("suffix_decoding_min_token_prob", 0.1)
        if not _number(least) or not 0 <= least <= 1:
            raise ValueError(
                "--speculative-config suffix_decoding_min_token_prob must be in [0, 1], not "
                f"{least!r}"
            )
        return cls(
            "suffix",
            tokens,
            adaptive=adaptive,
            suffix_decoding_max_tree_depth=depth,
            suffix_decoding_max_cached_requests=cached,
            suffix_decoding_max_spec_factor=float(factor),
            suffix_decoding_min_token_prob=float(least),
        )

    @classmethod
    def _draft_model(cls, value: dict[str, Any], adaptive: bool) -> SpeculativeConfig:
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(
                "--speculative-config method 'draft_model' needs 'model': a folder, a Hugging "
                "Face id or a GGUF file"
            )
        tokens = _count("num_speculative_tokens", value.get("num_speculative_tokens"))
        ranks = value.get("draft_tensor_parallel_size", 1)
        if ranks != 1 or isinstance(ranks, bool):
            raise ValueError(
                "--speculative-config draft_tensor_parallel_size must be 1 (the draft model "
                f"runs unsharded), not {ranks!r}"
            )
        quantization = value.get("quantization")
        if quantization is not None:
            try:
                check_quantization(quantization)
            except ValueError as exc:
                raise ValueError(f"--speculative-config quantization: {exc}") from None
        return cls("draft_model", tokens, adaptive=adaptive, model=model, quantization=quantization)

    def to_dict(self) -> dict[str, Any]:
        """The settings as `parse` takes them: the method's own keys only."""
        keys = ("method", "num_speculative_tokens", "adaptive", *METHOD_KEYS[self.method])
        return {key: getattr(self, key) for key in keys}

    def describe(self) -> str:
        """The startup block's line."""
        verified = (
            "the drafts worth their cost verified" if self.adaptive else "every draft verified"
        )
        if self.method == "draft_model":
            how = f"drafts by {self.model}"
        elif self.method == "suffix":
            how = (
                f"a trie {self.suffix_decoding_max_tree_depth} deep over each request and the "
                f"last {self.suffix_decoding_max_cached_requests} outputs"
            )
        else:
            how = f"n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max}"
        return f"{self.method}, {self.num_speculative_tokens} tokens a step, {how}, {verified}"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(key: str, number: Any, most: int = MAX_SPECULATIVE_TOKENS) -> int:
    """`number` as the setting `key`: an integer in [1, most]; ValueError naming it."""
    if number is None:
        raise ValueError(f"--speculative-config needs {key!r}")
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= most:
        raise ValueError(
            f"--speculative-config {key} must be an integer in [1, {most}], not {number!r}"
        )
    return number
