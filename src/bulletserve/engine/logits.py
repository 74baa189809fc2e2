"""What a request asks of its logits before the draw: the grammar's allowed tokens, an allowed
list, banned words, `logit_bias`, and the presence, frequency and repetition penalties (vLLM's
semantics).

Each is applied in place, batched over the rows that ask for it and only those: a step where no
row asks costs one check per row.
"""

from __future__ import annotations

import torch

from bulletserve.engine.request import Request
from bulletserve.engine.structured import allocate_bitmask, disallowed


def wants_processing(request: Request) -> bool:
    """Whether the request's logits are changed before its draw."""
    params = request.params
    return (
        request.grammar is not None
        or params.allowed_token_ids is not None
        or bool(request.bad_words_ids)
        or bool(params.logit_bias)
        or params.has_penalties
    )


def process_logits(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Apply each row's processing to float32 `logits` ([N, vocab]) in place; `rows` are the
    rows that want it (`wants_processing`)."""
    _mask_grammar(logits, requests, [i for i in rows if requests[i].grammar is not None])
    _allow_only(logits, requests, [i for i in rows if requests[i].params.allowed_token_ids])
    _ban_words(logits, requests, [i for i in rows if requests[i].bad_words_ids])
    _add_bias(logits, requests, [i for i in rows if requests[i].params.logit_bias])
    _penalize(logits, requests, [i for i in rows if requests[i].params.has_penalties])


def _mask_grammar(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = allocate_bitmask(len(rows), vocab)
    for k, row in enumerate(rows):
        grammar = requests[row].grammar
        assert grammar is not None
        grammar.fill(bitmask, k)
    index = torch.tensor(rows, device=logits.device)
    banned = disallowed(bitmask.to(logits.device), vocab)
    logits[index] = logits[index].masked_fill_(banned, float("-inf"))


def _allow_only(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    for row in rows:
        allowed = requests[row].params.allowed_token_ids
        assert allowed is not None
        keep = logits[row, allowed].clone()
        logits[row] = float("-inf")
        logits[row, allowed] = keep


def _ban_words(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """A bad word's last token is banned where the output ends with the rest of it (a word of
    one token: always), as vLLM's `bad_words`."""
    for row in rows:
        request = requests[row]
        output = request.output_token_ids
        banned = [
            ids[-1]
            for ids in request.bad_words_ids
            if len(ids) == 1
            or (len(output) >= len(ids) - 1 and output[-(len(ids) - 1) :] == ids[:-1])
        ]
        if banned:
            logits[row, banned] = float("-inf")


def _add_bias(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    if not rows:
        return
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for row in rows:
        bias = requests[row].params.logit_bias
        row_index += [row] * len(bias)
        token_index += list(bias)
        biases += list(bias.values())
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)),
        torch.tensor(biases, device=device),
        accumulate=True,
    )


def _penalize(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Presence and frequency penalties over the output's token counts, and the repetition
    penalty over every token of the prompt and the output (divides a positive logit, multiplies
    a negative one)."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    chosen = [requests[i] for i in rows]
    counts = torch.zeros(len(rows), vocab, device=device)
    outputs = [torch.tensor(r.output_token_ids, dtype=torch.long) for r in chosen]
    lengths = torch.tensor([len(ids) for ids in outputs])
    if int(lengths.sum()):
        owner = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        counts.index_put_(
            (owner.to(device), torch.cat(outputs).to(device)),
            torch.ones(int(lengths.sum()), device=device),
            accumulate=True,
        )
    index = torch.tensor(rows, device=device)
    sub = logits[index]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device).unsqueeze(1)

    repetition = [r.params.repetition_penalty for r in chosen]
    if any(p != 1.0 for p in repetition):
        seen = counts > 0
        for k, request in enumerate(chosen):
            seen[k, torch.tensor(request.prompt_token_ids, device=device)] = True
        factor = column(repetition)
        penalized = torch.where(sub > 0, sub / factor, sub * factor)
        sub = torch.where(seen, penalized, sub)
    frequency = column([r.params.frequency_penalty for r in chosen])
    presence = column([r.params.presence_penalty for r in chosen])
    sub -= frequency * counts + presence * (counts > 0)
    logits[index] = sub
