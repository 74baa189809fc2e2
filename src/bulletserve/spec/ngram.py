"""N-gram lookup drafting (prompt lookup decoding; vLLM's `ngram`, llama.cpp's `ngram-simple`):
where the n tokens that end a request's sequence occurred before in it, propose the tokens that
followed them there.

Kept per request as an index from each n-gram to where it was last followed, grown by each
token as it comes: a proposal is a few dictionary lookups, whatever the sequence's length
(vLLM's search of the whole sequence at every step took seconds on 50k-token prompts,
vllm#16883); indexing costs (max - min + 1) small tuples per token, once."""

from __future__ import annotations


class NgramIndex:
    """A sequence's tokens and, for each n in [low, high], where each n-gram in it was last
    followed by a token."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.tokens: list[int] = []
        self._followed: list[dict[tuple[int, ...], int]] = [{} for _ in range(low, high + 1)]

    def extend(self, tokens: list[int]) -> None:
        """Append `tokens` to the sequence."""
        seq, low = self.tokens, self.low
        for token in tokens:
            end = len(seq)
            for n in range(low, min(self.high, end) + 1):
                # The n-gram ending at the last token is followed by this one, at `end`.
                self._followed[n - low][tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, count: int) -> list[int]:
        """Up to `count` tokens: what followed the last occurrence of the longest n-gram that
        ends the sequence and occurred before (none where none did)."""
        seq = self.tokens
        end = len(seq)
        for n in range(min(self.high, end), self.low - 1, -1):
            at = self._followed[n - self.low].get(tuple(seq[end - n :]))
            if at is not None:
                return seq[at : at + count]
        return []
