"""Suffix decoding (SuffixDecoding, Oliaro et al.; vLLM's `suffix` through Snowflake's
arctic-inference, which has no build for this machine's Python on the registry, so ours):
drafts from a trie of token continuations, one per request over its prompt and output, and one
over the outputs of recently finished requests (repeated answers, agent loops).

A trie holds every substring of its sequences up to `depth` tokens, each node counting how
often its path occurred. A proposal finds the longest suffix of the request's tokens that is a
path that something followed (up to depth - 1 tokens), then follows the most frequent
child while its share of its parent's count is at least `min_token_prob`, for at most
`max_spec_factor` x the match's length tokens: a long match earns a long draft, a short one a
short draft (the match and the draft share the trie's depth: of a long match only as much is
used as leaves the longest draft). Of the two tries' drafts the one with the higher expected
accepted length (the sum of the running products of the shares) goes.

Bounded: a sequence of n tokens adds at most n x depth nodes, at `depth` steps a token; the
global trie holds the outputs of `max_cached_requests` requests and `MAX_CACHED_NODES` nodes at
most, and forgets the oldest first (its counts taken back off the trie)."""

from __future__ import annotations

from collections import deque

# The global trie's bound in nodes, whatever `max_cached_requests` allows: about 150 MB of
# Python objects (a node and its dict of children).
MAX_CACHED_NODES = 500_000


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """The substrings of up to `depth` tokens of the sequences added, with their counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0

    def add(self, tokens: list[int], open_paths: list[_Node] | None = None) -> list[_Node]:
        """Count the substrings of a sequence that end in `tokens`: `open_paths` are the
        nodes of the sequence's suffixes before them (shortest first, at most depth - 1; none
        for a new sequence), and the same for after them comes back. Each token extends every
        open path by one node, so a token costs `depth` steps."""
        paths = list(open_paths or [])
        for token in tokens:
            grown = []
            for node in (self.root, *paths):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.num_nodes += 1
                child.count += 1
                grown.append(child)
            paths = grown[: self.depth - 1]
        return paths

    def remove(self, tokens: list[int]) -> None:
        """Take back what `add(tokens)` counted for a whole sequence; a node counted down to
        none leaves its parent."""
        paths: list[_Node] = []
        for token in tokens:
            grown = []
            for node in (self.root, *paths):
                child = node.children.get(token)
                if child is None:  # its count went with a parent taken off before
                    continue
                child.count -= 1
                if child.count <= 0:
                    del node.children[token]
                    self.num_nodes -= 1
                grown.append(child)
            paths = grown[: self.depth - 1]

    def _walk(self, tokens: list[int], begin: int, end: int) -> _Node | None:
        """The node of tokens[begin:end] (the root for an empty path; None: not in the trie)."""
        node = self.root
        for position in range(begin, end):
            node = node.children.get(tokens[position])
            if node is None:
                return None
        return node

    def propose(
        self, context: list[int], count: int, max_spec_factor: float, min_token_prob: float
    ) -> tuple[list[int], float]:
        """A draft of at most `count` tokens to follow `context`, and its expected accepted
        length (the sum of the running products of each token's share)."""
        longest = min(len(context), self.depth - 1)
        # The longest suffix of the context that is a path with a continuation (in a request's
        # own trie the context's own end is a path that nothing follows yet): where a suffix
        # has one, every shorter suffix has it too, so the lengths are searched by halves.
        low, high = 0, longest
        while low < high:
            middle = (low + high + 1) // 2
            found = self._walk(context, len(context) - middle, len(context))
            if found is None or not found.children:
                high = middle - 1
            else:
                low = middle
        if low == 0:
            return [], 0.0
        # A match of m tokens leaves depth - m below it and earns max_spec_factor x m: the
        # longest match among those that make the longest draft.
        length = max(
            range(1, low + 1),
            key=lambda m: (min(count, int(max_spec_factor * m), self.depth - m), m),
        )
        room = min(count, int(max_spec_factor * length), self.depth - length)
        node = self._walk(context, len(context) - length, len(context))
        assert node is not None
        draft: list[int] = []
        expected, share = 0.0, 1.0
        while len(draft) < room and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            total = sum(c.count for c in node.children.values())
            if child.count / total < min_token_prob:
                break
            share *= child.count / total
            expected += share
            draft.append(token)
            node = child
        return draft, expected


class SuffixCache:
    """The global trie: the outputs of the last `max_requests` finished requests."""

    def __init__(self, depth: int, max_requests: int, max_nodes: int = MAX_CACHED_NODES) -> None:
        self.trie = SuffixTrie(depth)
        self.max_requests = max_requests
        self.max_nodes = max_nodes
        self._outputs: deque[list[int]] = deque()

    def add(self, output: list[int]) -> None:
        if not output or self.max_requests == 0:
            return
        self.trie.add(output)
        self._outputs.append(output)
        trie = self.trie
        while self._outputs and (
            len(self._outputs) > self.max_requests or trie.num_nodes > self.max_nodes
        ):
            trie.remove(self._outputs.popleft())


class SuffixDrafter:
    """One request's drafts: its own trie over its prompt and output, and the global cache's."""

    def __init__(
        self,
        prompt: list[int],
        cache: SuffixCache,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> None:
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.cache = cache
        self.own = SuffixTrie(cache.trie.depth)
        self._open = self.own.add(self.tokens)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self._open = self.own.add(tokens, self._open)

    def propose(self, count: int) -> list[int]:
        factor, least = self.max_spec_factor, self.min_token_prob
        own, own_score = self.own.propose(self.tokens, count, factor, least)
        cached, cached_score = self.cache.trie.propose(self.tokens, count, factor, least)
        return cached if cached_score > own_score else own
