"""A draft model (vLLM's `draft_model`): a smaller model of the target's vocabulary, with its
own weights, KV pool and runner, that drafts for every decoding request in batched forwards.

Each step, for the requests that may draft: one forward catches each request's draft KV up over
the tokens it has not computed (the whole prompt at first, then the tokens the target accepted
since) and takes its first draft from the logits at the request's last token; each further
forward feeds every request's last draft and takes the next, so k drafts cost k forwards of the
small model, all requests together. A row given a temperature draws its drafts from the draft
model's distribution at it (q), which the target's verification takes for rejection sampling
(`engine.sampler.Proposal`); the others take the draft model's argmax, a one-hot q, whose
verification keeps a seeded request's text the one decoding without speculation gives.

The KV of a request's drafts stays in the draft's cache; at the next step the drafts the
target accepted are kept (their KV was computed over the right tokens) and the rest are
overwritten, as positions past the request's tokens are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from bulletserve.engine.model_runner import ModelRunner, SeqWork
from bulletserve.kv.pool import KVPool
from bulletserve.model.decoder import LogitsBuffer
from bulletserve.model.loader import load_config, load_model
from bulletserve.model.source import resolve_model
from bulletserve.model.tokenizer import load_tokenizer
from bulletserve.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRow:
    """A request to draft for: its tokens so far, how many drafts, and the temperature to draw
    them at (None: the argmax)."""

    request_id: str
    tokens: list[int]
    count: int
    temperature: float | None = None


@dataclass
class _DraftKV:
    """A request's state in the draft's cache: its blocks, how many of its tokens have their
    KV there, and the drafts whose KV follows them (written at the last step)."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    drafts: list[int] = field(default_factory=list)


class DraftModel:
    """Drafts for many requests at once (`propose`); a request's draft KV lives until `forget`."""

    def __init__(self, runner: ModelRunner, pool: KVPool, vocab_size: int, seed: int = 0) -> None:
        self.runner = runner
        self.pool = pool
        self.vocab_size = vocab_size  # the target's: a larger draft vocabulary is cut to it
        self._kv: dict[str, _DraftKV] = {}
        self._logits = LogitsBuffer()
        self._generator = torch.Generator(device=runner.device).manual_seed(seed)

    @classmethod
    def load(
        cls,
        config: SpeculativeConfig,
        target_tokenizer: PreTrainedTokenizerBase,
        target_vocab: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
    ) -> DraftModel:
        """The draft model `config.model` names, its tokenizer checked against the target's
        (ValueError naming what differs), with a KV pool of `num_blocks` blocks (the
        target's, and room for each request's drafts)."""
        assert config.model is not None
        source = resolve_model(config.model)
        draft_config = load_config(source)
        name = f"--speculative-config model {config.model!r}"
        check_same_tokenizer(target_tokenizer, load_tokenizer(source), name)
        if draft_config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"{name} holds {draft_config.max_position_embeddings} positions, fewer than "
                f"--max-model-len {max_model_len}"
            )
        model = load_model(
            source, dtype, device, max_model_len, seed=seed, quantization=config.quantization
        )
        pool = KVPool(model.shard_config, num_blocks, block_size, dtype, device)
        logger.info(
            "draft model %s: %d layers, hidden %d, KV pool of %d blocks",
            source.name,
            draft_config.num_layers,
            draft_config.hidden_size,
            num_blocks,
        )
        return cls(ModelRunner(model, pool, device), pool, target_vocab, seed)

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[tuple[list[int], list[torch.Tensor] | None]]:
        """Each row's drafts, up to its count (fewer where the draft's KV pool runs out of
        blocks: none for a row it cannot hold), and for a row with a temperature the
        distribution each was drawn from ([V] probabilities, where the logits are)."""
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor] | None] = [
            None if row.temperature is None else [] for row in rows
        ]
        works, live = [], []
        for index, row in enumerate(rows):
            tokens = row.tokens
            kv = self._kv.setdefault(row.request_id, _DraftKV())
            kept = 0
            for position, draft in enumerate(kv.drafts, start=kv.computed):
                if position >= len(tokens) - 1 or tokens[position] != draft:
                    break
                kept += 1
            kv.computed, kv.drafts = min(kv.computed + kept, len(tokens) - 1), []
            # The KV of the tokens and of all but the last draft.
            if not self._grow(kv, len(tokens) + row.count - 1):
                continue
            works.append(SeqWork(tokens[kv.computed :], kv.computed, kv.blocks, True))
            kv.computed = len(tokens)
            live.append(index)
        step = 0
        while works:
            logits, order = self.runner.execute(works, self._logits)
            owners = [live[work] for work in order]  # each logits row's row of `rows`
            picked = self._pick(logits[:, : self.vocab_size], [rows[i] for i in owners])
            by_work = {}
            for work, owner, (token, q) in zip(order, owners, picked, strict=True):
                by_work[work] = token
                if q is not None:
                    kept_probs = probs[owner]
                    assert kept_probs is not None
                    kept_probs.append(q)
            step += 1
            next_works, next_live = [], []
            for work_index, index in enumerate(live):
                token = by_work[work_index]
                drafts[index].append(token)
                row = rows[index]
                if step < row.count:
                    kv = self._kv[row.request_id]
                    kv.drafts.append(token)
                    start = len(row.tokens) + step - 1
                    next_works.append(SeqWork([token], start, kv.blocks, True))
                    next_live.append(index)
            works, live = next_works, next_live
        return list(zip(drafts, probs, strict=True))

    def _pick(
        self, logits: torch.Tensor, rows: list[DraftRow]
    ) -> list[tuple[int, torch.Tensor | None]]:
        """Each logits row's draft: the argmax, or for a row with a temperature a token drawn
        from the distribution at it, with that distribution."""
        tokens = logits.argmax(dim=-1)
        tempered = [k for k, row in enumerate(rows) if row.temperature is not None]
        q: torch.Tensor | None = None
        if tempered:
            index = torch.tensor(tempered, device=logits.device)
            scale = torch.tensor(
                [rows[k].temperature for k in tempered], device=logits.device
            ).unsqueeze(1)
            q = torch.softmax(logits[index].float() / scale, dim=-1)
            tokens[index] = torch.multinomial(q, 1, generator=self._generator).squeeze(1)
        picked: list[tuple[int, torch.Tensor | None]] = [(t, None) for t in tokens.tolist()]
        for position, k in enumerate(tempered):
            assert q is not None
            picked[k] = (picked[k][0], q[position])
        return picked

    def forget(self, request_id: str) -> None:
        """The request left the running set: its draft KV is freed."""
        kv = self._kv.pop(request_id, None)
        if kv is not None and kv.blocks:
            self.pool.allocator.free(kv.blocks)

    def _grow(self, kv: _DraftKV, num_tokens: int) -> bool:
        """Blocks for `num_tokens` positions; False where the pool has too few free."""
        size = self.pool.block_size
        need = -(-num_tokens // size) - len(kv.blocks)
        if need <= 0:
            return True
        if need > self.pool.allocator.num_free:
            return False
        kv.blocks.extend(self.pool.allocator.allocate(need))
        return True


def check_same_tokenizer(
    target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, name: str
) -> None:
    """ValueError naming the first difference unless the draft's tokenizer maps every token as
    the target's does (a draft's token id must mean the target's token)."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        raise ValueError(
            f"{name}: its tokenizer has {len(draft_vocab)} tokens, the target's "
            f"{len(target_vocab)}; a draft model must share the target's tokenizer"
        )
    for token, token_id in target_vocab.items():
        if draft_vocab.get(token) != token_id:
            raise ValueError(
                f"{name}: its tokenizer maps {token!r} to {draft_vocab.get(token)}, the target's "
                f"to {token_id}; a draft model must share the target's tokenizer"
            )
