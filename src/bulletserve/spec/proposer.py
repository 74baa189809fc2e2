"""The method's proposer for every drafting request, as the engine and the simulator both run
it: each request's index of its tokens (n-gram lookup, or suffix decoding's trie and the
shared cache of recent outputs), kept up to date with its output and forgotten when it
leaves."""

from __future__ import annotations

from collections.abc import Sequence

from bulletserve.spec.config import SpeculativeConfig
from bulletserve.spec.ngram import NgramIndex
from bulletserve.spec.suffix import SuffixCache, SuffixDrafter

Drafter = NgramIndex | SuffixDrafter


def draft_room(
    config: SpeculativeConfig,
    num_tokens: int,
    num_computed_tokens: int,
    num_output_tokens: int,
    max_tokens: int,
    max_model_len: int,
) -> int:
    """How many drafts a request's next row may carry (the engine's and the simulator's
    rule): none unless it decodes (its last token alone to compute, its output begun), else
    `num_speculative_tokens`, no more than its max_tokens and the context length leave room for
    after the token the row draws."""
    if num_computed_tokens != num_tokens - 1 or not num_output_tokens:
        return 0
    room = min(
        config.num_speculative_tokens,
        max_tokens - num_output_tokens - 1,
        max_model_len - num_tokens - 1,
    )
    return max(room, 0)


class Proposer:
    """Drafts per request (`propose`), from an index built on its first proposal."""

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method not in ("ngram", "suffix"):
            raise ValueError(f"{config.method} drafts with a model, not an index of tokens")
        self.config = config
        self._drafters: dict[str, Drafter] = {}
        self.suffix_cache = None
        if config.method == "suffix":
            self.suffix_cache = SuffixCache(
                config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests
            )

    def propose(
        self, request_id: str, prompt: Sequence[int], output: Sequence[int], count: int
    ) -> list[int]:
        """Up to `count` tokens to follow `prompt` + `output`."""
        drafter = self._drafters.get(request_id)
        if drafter is None:
            drafter = self._drafters[request_id] = self._drafter(list(prompt))
        drafter.extend(list(output[len(drafter.tokens) - len(prompt) :]))
        return drafter.propose(count)

    def forget(self, request_id: str, finished_output: Sequence[int] | None) -> None:
        """A request left the running set: its index goes; a finished one's output
        (`finished_output`) joins suffix decoding's cache of recent outputs."""
        self._drafters.pop(request_id, None)
        if self.suffix_cache is not None and finished_output is not None:
            self.suffix_cache.add(list(finished_output))

    def _drafter(self, prompt: list[int]) -> Drafter:
        """A new request's index, its prompt in it."""
        config = self.config
        if self.suffix_cache is not None:
            return SuffixDrafter(
                prompt,
                self.suffix_cache,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )
        index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        index.extend(prompt)
        return index
