"""Reasoning models' output split into its reasoning and its answer (`--reasoning-parser`, as
vLLM's): the text between `<think>` and `</think>` is the reasoning, what follows the answer.

- `deepseek_r1`: the whole output is reasoning until `</think>` (the chat template may have
  opened `<think>` in the prompt; an opening tag in the output is dropped); an output that
  never closes the block is reasoning alone.
- `qwen3`: the output thinks only when it opens with `<think>` (after any whitespace); else it
  is all answer, and with `enable_thinking: false` it is always all answer. An opened block
  that never closes is reasoning alone.

The split is a function of the text so far: a stream sends what each step adds to either part,
holding back a tail that may yet become a tag (`<thi` could be `<think>`), so that a stream's
parts joined are the whole response's split, a tag cut across two deltas included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasoningParserName = Literal["deepseek_r1", "qwen3"]
REASONING_PARSERS: tuple[ReasoningParserName, ...] = ("deepseek_r1", "qwen3")

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """An output's reasoning and answer (`content`); None where it has none."""

    reasoning: str | None
    content: str | None


def _partial_tag_at_end(text: str, tag: str) -> int:
    """How many of `text`'s last characters are a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    name: ReasoningParserName
    thinking: bool = True  # the request's `enable_thinking` (chat_template_kwargs)

    @property
    def thinks(self) -> bool:
        """Whether an output may hold reasoning (qwen3 with thinking off holds none)."""
        return self.thinking or self.name != "qwen3"

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """`text`'s reasoning and answer; until `finished`, a tail that may be part of a tag
        is in neither."""
        if self.name == "qwen3" and not self.thinking:
            return ReasoningSplit(None, text)
        body = text
        if self.name == "qwen3":
            stripped = text.lstrip()
            if not stripped.startswith(START):
                if not finished and START.startswith(stripped):
                    return ReasoningSplit(None, None)  # may yet open the block
                return ReasoningSplit(None, text)
            body = stripped[len(START) :]
        else:
            stripped = text.lstrip()
            if stripped.startswith(START):
                body = stripped[len(START) :]
            elif not finished and START.startswith(stripped):
                return ReasoningSplit(None, None)  # may yet open the block
        reasoning, closed, answer = body.partition(END)
        if closed:
            return ReasoningSplit(reasoning, answer or None)
        if not finished:
            reasoning = reasoning[: len(reasoning) - _partial_tag_at_end(reasoning, END)]
        return ReasoningSplit(reasoning, None)


@dataclass
class ReasoningStream:
    """What a streamed choice has sent of each part; `advance` gives each step's new text."""

    parser: ReasoningParser
    sent_reasoning: int = 0
    sent_content: int = 0
    answering: bool = False  # whether the reasoning has ended (the answer may be empty yet)

    def advance(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new answer) since the last call, for the output's text so far."""
        split = self.parser.split(text, finished)
        self.answering = split.content is not None
        reasoning = (split.reasoning or "")[self.sent_reasoning :]
        content = (split.content or "")[self.sent_content :]
        self.sent_reasoning += len(reasoning)
        self.sent_content += len(content)
        return reasoning, content


def reasoning_tokens(token_ids: list[int], split: ReasoningSplit, decode) -> int:
    """How many of the output's tokens are its reasoning (its tags included): all of them
    where the block never closes, else the fewest whose text holds the closing tag (found by
    bisection, a few decodes)."""
    if split.reasoning is None:
        return 0
    if split.content is None and END not in decode(token_ids):
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if END in decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low
