"""The `grounded` workload: requests whose answer is mostly in their prompt (copy, quote,
rewrite or summarize a passage of real text or code), where speculative decoding's drafts
from the prompt hold; beside the chat-like presets, where they mostly do not.

The passages come from what the package ships: the license texts of `bullet perplexity`
(accuracy/texts: the GNU GPL 3 and the Apache License 2.0, whose terms permit verbatim copies)
and bulletserve's own Python source (Apache-2.0). Each request takes a passage of a drawn length
at a drawn place, cut at line ends, and one of the tasks below; it asks for as many output
tokens as the passage has (a copy's length)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

PACKAGE = Path(__file__).resolve().parent.parent
TEXTS = PACKAGE / "accuracy" / "texts"  # `bullet perplexity`'s texts, read as files here
# (task, whether it works on code): the passage goes where {passage} is.
TASKS: tuple[tuple[str, bool], ...] = (
    ("Copy the following text exactly, word for word.\n\n{passage}\n\nCopy:\n", False),
    (
        "Quote the passage below in full, then say in one sentence what it is about.\n\n"
        "{passage}\n\nQuote:\n",
        False,
    ),
    (
        "Rewrite the passage below in plain English, keeping its sentences where you can.\n\n"
        "{passage}\n\nRewritten:\n",
        False,
    ),
    ("Summarize this passage, quoting its key sentences.\n\n{passage}\n\nSummary:\n", False),
    (
        "Add a comment above each function in this Python code and repeat the code otherwise "
        "unchanged.\n\n```python\n{passage}\n```\n\nThe code with comments:\n```python\n",
        True,
    ),
    (
        "Repeat this Python code exactly, fixing any typo you find in its comments.\n\n"
        "```python\n{passage}\n```\n\n```python\n",
        True,
    ),
)
GROUNDED = "grounded"  # its dataset spec
MIN_PASSAGE_TOKENS = 96
MAX_PASSAGE_TOKENS = 512


@dataclass(frozen=True)
class GroundedRequest:
    prompt: str
    input_len: int
    output_len: int


def _sources() -> tuple[list[str], list[str]]:
    """(prose, code): the shipped texts and the package's Python modules of over 40 lines."""
    prose = [(TEXTS / name).read_text() for name in ("apache-2.0.txt", "gpl-3.0.txt")]
    code = [path.read_text() for path in sorted(PACKAGE.rglob("*.py"))]
    return prose, [text for text in code if text.count("\n") > 40]


def grounded_requests(
    num_prompts: int,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[GroundedRequest]:
    """`num_prompts` grounded requests, each passage of MIN to MAX_PASSAGE_TOKENS tokens (less
    where `max_model_len` leaves no room for a prompt and its copy)."""
    rng = np.random.default_rng(seed)
    prose, code = _sources()
    most = MAX_PASSAGE_TOKENS
    if max_model_len is not None:
        most = min(most, (max_model_len - 64) // 2)
    if most < 8:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a grounded request")
    least = min(MIN_PASSAGE_TOKENS, most)
    requests = []
    for _ in range(num_prompts):
        template, on_code = TASKS[int(rng.integers(len(TASKS)))]
        sources = code if on_code else prose
        text = sources[int(rng.integers(len(sources)))]
        passage = _passage(text, int(rng.integers(least, most + 1)), rng, tokenizer)
        prompt = template.format(passage=passage)
        length = len(tokenizer.encode(passage, add_special_tokens=False))
        input_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(GroundedRequest(prompt, input_len, max(1, length)))
    return requests


def _passage(
    text: str, tokens: int, rng: np.random.Generator, tokenizer: PreTrainedTokenizerBase
) -> str:
    """Whole lines of `text` from a drawn line on, about `tokens` tokens (at most that many)."""
    lines = text.splitlines(keepends=True)
    start = int(rng.integers(max(1, len(lines) - 8)))
    taken: list[str] = []
    count = 0
    for line in lines[start:]:
        cost = len(tokenizer.encode(line, add_special_tokens=False))
        if count + cost > tokens and taken:
            break
        taken.append(line)
        count += cost
    return "".join(taken).rstrip("\n")
