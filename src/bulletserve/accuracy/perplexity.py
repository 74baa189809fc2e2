"""Perplexity of a model over a text (`bullet perplexity`: cli/perplexity.py), computed as
llama.cpp's `llama-perplexity` does, so that the two agree on the same file and tokens: the text
tokenized once, cut into chunks of `context` tokens (the first made BOS where the tokenizer adds
one), each chunk run alone, and only the second half of each chunk scored (every scored token
then has at least context / 2 before it)."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bulletserve.engine.model_runner import ModelRunner, SeqWork
from bulletserve.kv.pool import KVPool
from bulletserve.model.decoder import DecoderLM

TEXTS = Path(__file__).parent / "texts"
DEFAULT_TEXTS = (TEXTS / "gpl-3.0.txt", TEXTS / "apache-2.0.txt")
DEFAULT_CONTEXT = 512  # llama-perplexity's default --ctx-size
BLOCK_SIZE = 16
LOGIT_ROWS = 128  # logits computed this many rows at a time (a 128K vocabulary's are 64 MB)


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    scored_tokens: int
    chunks: int
    context: int
    text_tokens: int
    seconds: float


def default_text() -> str:
    """The shipped texts, one line after another with each line's runs of whitespace made one
    space and blank lines dropped: Hugging Face's tokenizers and llama.cpp's split runs of
    spaces and newlines before a digit differently (SmolLM2's GGUF: 9,882 against 9,854 tokens
    of the texts as they are), and as reflowed here both give the same tokens."""
    lines = (
        re.sub(r"\s+", " ", line).strip()
        for p in DEFAULT_TEXTS
        for line in p.read_text().splitlines()
    )
    return "\n".join(line for line in lines if line) + "\n"


def perplexity(
    model: DecoderLM,
    device: torch.device,
    tokens: list[int],
    context: int = DEFAULT_CONTEXT,
    bos_token_id: int | None = None,
    max_chunks: int | None = None,
) -> Perplexity:
    """The perplexity of `model` over `tokens` (see the module's docstring); `bos_token_id`: the
    token each chunk starts with, where the tokenizer adds one."""
    if context < 4:
        raise ValueError(f"--ctx-size must be at least 4, got {context}")
    chunks = len(tokens) // context
    if max_chunks is not None:
        chunks = min(chunks, max_chunks)
    if chunks < 1:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one chunk of {context}")
    blocks = -(-context // BLOCK_SIZE)
    pool = KVPool(model.config, blocks, BLOCK_SIZE, model.dtype, device)
    runner = ModelRunner(model, pool, device)
    first = context // 2
    start_time = time.perf_counter()
    total = 0.0
    with torch.inference_mode():
        for index in range(chunks):
            chunk = tokens[index * context : (index + 1) * context]
            if bos_token_id is not None:
                chunk[0] = bos_token_id
            block_table = pool.allocator.allocate(blocks)
            try:
                batch = runner.prepare([SeqWork(chunk, 0, block_table, True)])
                hidden = model.run_layers(
                    model.embed(batch.input_ids), batch.positions, pool.layers, batch.meta
                )
                targets = torch.tensor(chunk[first + 1 :], device=device)
                for row in range(first, context - 1, LOGIT_ROWS):
                    end = min(row + LOGIT_ROWS, context - 1)
                    logits = model.logits(hidden, torch.arange(row, end, device=device))
                    logprobs = torch.log_softmax(logits.double(), dim=-1)
                    picked = targets[row - first : end - first].unsqueeze(1)
                    total -= float(logprobs.gather(1, picked).sum())
            finally:
                pool.allocator.free(block_table)
    scored = chunks * (context - 1 - first)
    return Perplexity(
        math.exp(total / scored),
        scored,
        chunks,
        context,
        len(tokens),
        time.perf_counter() - start_time,
    )
