"""Workloads whose prompts share prefixes, for prefix caching.

- `shared-prefix` (SGLang's generated-shared-prefix): a few long system prompts, each shared by
  many requests that add their own question.
- `multi-turn`: conversations that resend their whole history at every turn. The bench asks a
  turn for as many tokens as the reply the next turn resends, but that reply is a stand-in of
  the same length, not the model's words: a cache finds the earlier turns' prompts, not their
  outputs. Requests go out turn by turn: every conversation's first turn, then every second
  turn, and so on.

A prompt is a sequence of segments; requests that name the same segment share its tokens, so a
server (or the simulator, with token ids made from the segment names) can reuse their KV.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

SHARED_PREFIX_KINDS = ("shared-prefix", "multi-turn")
SYSTEM_PROMPTS = 4
SYSTEM_LEN = 512
QUESTION_LEN = 128
ANSWER_LEN = 128
TURNS = 4
USER_LEN = 128
REPLY_LEN = 128


@dataclass(frozen=True)
class Segment:
    key: str  # requests whose segments have the same key share these tokens
    length: int


@dataclass(frozen=True)
class SharedPrompt:
    segments: tuple[Segment, ...]
    output_len: int

    @property
    def input_len(self) -> int:
        return sum(segment.length for segment in self.segments)

    def token_ids(self) -> tuple[int, ...]:
        """Stand-in token ids: the same for the same segment, in every process (for the
        simulator, which has no tokenizer)."""
        ids: list[int] = []
        for segment in self.segments:
            base = zlib.crc32(segment.key.encode()) << 20
            ids.extend(base + i for i in range(segment.length))
        return tuple(ids)


def _around(mean: int, size: int, rng: np.random.Generator) -> list[int]:
    """Lengths uniform in [mean / 2, 3 mean / 2]."""
    return rng.integers(max(1, mean // 2), mean * 3 // 2 + 1, size=size).tolist()


def _scale(mean: int, factor: float) -> int:
    return max(2, int(mean * factor))


def shared_prefix_prompts(
    num_prompts: int, rng: np.random.Generator, max_model_len: int | None = None
) -> list[SharedPrompt]:
    """`num_prompts` requests over `SYSTEM_PROMPTS` system prompts of about `SYSTEM_LEN`
    tokens, each with its own question and answer; lengths scaled down to fit the context."""
    longest = (SYSTEM_LEN + QUESTION_LEN + ANSWER_LEN) * 3 // 2
    factor = min(1.0, (max_model_len or longest) / longest)
    systems = _around(_scale(SYSTEM_LEN, factor), SYSTEM_PROMPTS, rng)
    groups = rng.integers(SYSTEM_PROMPTS, size=num_prompts).tolist()
    questions = _around(_scale(QUESTION_LEN, factor), num_prompts, rng)
    answers = _around(_scale(ANSWER_LEN, factor), num_prompts, rng)
    return [
        SharedPrompt(
            (Segment(f"system-{g}", systems[g]), Segment(f"question-{i}", questions[i])),
            answers[i],
        )
        for i, g in enumerate(groups)
    ]


def multi_turn_prompts(
    num_prompts: int, rng: np.random.Generator, max_model_len: int | None = None
) -> list[SharedPrompt]:
    """Conversations of `TURNS` turns (the last one cut short at `num_prompts` requests), each
    turn's prompt the whole history so far; lengths scaled down to fit the context."""
    longest = TURNS * (USER_LEN + REPLY_LEN) * 3 // 2
    factor = min(1.0, (max_model_len or longest) / longest)
    conversations = -(-num_prompts // TURNS)
    users = [_around(_scale(USER_LEN, factor), TURNS, rng) for _ in range(conversations)]
    replies = [_around(_scale(REPLY_LEN, factor), TURNS, rng) for _ in range(conversations)]
    prompts = []
    for turn in range(TURNS):
        for c in range(conversations):
            if len(prompts) == num_prompts:
                return prompts
            history = []
            for earlier in range(turn + 1):
                history.append(Segment(f"conversation-{c}-user-{earlier}", users[c][earlier]))
                if earlier < turn:
                    reply = Segment(f"conversation-{c}-reply-{earlier}", replies[c][earlier])
                    history.append(reply)
            prompts.append(SharedPrompt(tuple(history), replies[c][turn]))
    return prompts


def shared_prompts(
    kind: str, num_prompts: int, seed: int, max_model_len: int | None = None
) -> list[SharedPrompt]:
    rng = np.random.default_rng(seed)
    if kind == "shared-prefix":
        return shared_prefix_prompts(num_prompts, rng, max_model_len)
    if kind == "multi-turn":
        return multi_turn_prompts(num_prompts, rng, max_model_len)
    raise ValueError(f"not a shared-prefix workload: {kind!r}")
