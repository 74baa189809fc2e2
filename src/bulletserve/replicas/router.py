"""Where a request goes among the replicas: the healthy one with the fewest waiting prompt
tokens, unless a replica that served the same prompt prefix (and so holds its KV in its prefix
cache) is within `affinity_slack_tokens` of that. Pure: loads in, a replica out.

Waiting tokens are the router's own count: the prompt tokens of the requests it sent to a
replica that have not had their first token yet (the work queued in front of a new prompt there,
known at once, where a replica's polled statistics would lag).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class NoReplicaError(RuntimeError):
    """Every replica has died."""


@dataclass(frozen=True)
class ReplicaLoad:
    healthy: bool
    waiting_tokens: int  # prompt tokens sent there and not yet past their first token
    open_streams: int  # requests sent there and not finished


# A prefix is the prompt's first full blocks, up to this many tokens (system prompts and
# conversation histories share their beginnings).
PREFIX_TOKENS = 256
PREFIX_BLOCK = 16


def prefix_key(token_ids: Sequence[int]) -> int | None:
    """The key of a prompt's prefix (None: shorter than one block)."""
    length = min(PREFIX_TOKENS, len(token_ids)) // PREFIX_BLOCK * PREFIX_BLOCK
    return hash(tuple(token_ids[:length])) if length else None


@dataclass
class Router:
    """`choose` a replica for each request; `affinity`: route by prefix at all (the replicas
    cache prefixes)."""

    affinity: bool = True
    affinity_slack_tokens: int = 4096
    max_prefixes: int = 100_000

    def __post_init__(self) -> None:
        self._homes: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica, LRU

    def choose(self, loads: Sequence[ReplicaLoad], key: int | None) -> int:
        healthy = [i for i, load in enumerate(loads) if load.healthy]
        if not healthy:
            raise NoReplicaError("every replica has died")
        least = min(healthy, key=lambda i: (loads[i].waiting_tokens, loads[i].open_streams, i))
        chosen = least
        if self.affinity and key is not None:
            home = self._homes.get(key)
            slack = self.affinity_slack_tokens
            if home is not None and loads[home].healthy:
                if loads[home].waiting_tokens <= loads[least].waiting_tokens + slack:
                    chosen = home
            self._homes[key] = chosen
            self._homes.move_to_end(key)
            if len(self._homes) > self.max_prefixes:
                self._homes.popitem(last=False)
        return chosen
