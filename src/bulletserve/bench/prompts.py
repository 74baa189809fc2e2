"""Prompts of an exact token length under a given tokenizer.

A prompt is a run of random whole-word tokens (" apple", " river", ...), each of which the
tokenizer maps back to exactly one token; the length is then checked by encoding the text
(without special tokens, as servers count the prompt's own tokens) and adjusted until it holds.
Random words per request keep servers' prefix caches from sharing work between requests.
"""

from __future__ import annotations

import re

import numpy as np
from transformers import PreTrainedTokenizerBase

_WORD = re.compile(r"^(?:Ġ|▁| )([a-z]{3,12})$")
_MAX_WORDS = 2000
_MAX_ADJUSTMENTS = 16


class PromptBuilder:
    """Builds prompts of exact token lengths for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self._rng = np.random.default_rng(seed)
        self._words = self._single_token_words()

    def _single_token_words(self) -> list[str]:
        words = []
        for token, _ in sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1]):
            match = _WORD.match(token)
            if match and len(self.count(" " + match.group(1))) == 1:
                words.append(" " + match.group(1))
                if len(words) >= _MAX_WORDS:
                    break
        if len(words) < 100:
            raise ValueError("the tokenizer has too few plain word tokens to build prompts from")
        return words

    def count(self, text: str) -> list[int]:
        """The token ids of a prompt, as the server counts them (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build(self, num_tokens: int) -> str:
        """A prompt of exactly num_tokens tokens."""
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least one token, not {num_tokens}")
        pieces = [self._words[i] for i in self._rng.integers(len(self._words), size=num_tokens)]
        for _ in range(_MAX_ADJUSTMENTS):
            have = len(self.count("".join(pieces)))
            if have == num_tokens:
                return "".join(pieces)
            if have > num_tokens:
                del pieces[max(1, len(pieces) - (have - num_tokens)) :]
            else:
                extra = self._rng.integers(len(self._words), size=num_tokens - have)
                pieces.extend(self._words[i] for i in extra)
        raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens")
