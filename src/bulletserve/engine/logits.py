"""What a request asks of its logits before the draw: the grammar's allowed tokens, an allowed
list, banned words, `logit_bias`, the presence, frequency and repetition penalties (vLLM's
semantics), and last a forced token (a spent reasoning budget's end).

Each is applied in place, batched over the rows that ask for it and only those: a step where no
row asks costs one check per row.
"""

from __future__ import annotations

import torch

from bulletserve.engine.request import Request
from bulletserve.engine.structured import allocate_bitmask, disallowed
from bulletserve.model.cpu_kernels import SamplingKernel


def wants_processing(request: Request) -> bool:
    """Whether the request's logits are changed before its draw."""
    params = request.params
    return (
        request.grammar is not None
        or params.allowed_token_ids is not None
        or bool(request.bad_words_ids)
        or bool(params.logit_bias)
        or params.has_penalties
        or bool(request.forced_tokens)
    )


def process_logits(
    logits: torch.Tensor,
    requests: list[Request],
    rows: list[int],
    kernel: SamplingKernel | None = None,
) -> None:
    """Apply each row's processing to float32 `logits` ([N, vocab]) in place; `rows` are the
    rows that want it (`wants_processing`). `kernel`: our CPU sampling kernel, which applies
    grammar masks in one pass (PyTorch's masked_fill took 13 ms for 64 rows of 49K)."""
    grammar_rows = [i for i in rows if requests[i].grammar is not None]
    _mask_grammar(logits, requests, grammar_rows, kernel)
    _allow_only(logits, requests, [i for i in rows if requests[i].params.allowed_token_ids])
    _ban_words(logits, requests, [i for i in rows if requests[i].bad_words_ids])
    _add_bias(logits, requests, [i for i in rows if requests[i].params.logit_bias])
    _penalize(logits, requests, [i for i in rows if requests[i].params.has_penalties])
    _force(logits, requests, [i for i in rows if requests[i].forced_tokens])


def _force(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """A row whose next token is forced (the end of a spent reasoning budget) may draw it alone,
    whatever else its logits were given."""
    for row in rows:
        logits[row] = float("-inf")
        logits[row, requests[row].forced_tokens[0]] = 0.0


def _mask_grammar(
    logits: torch.Tensor,
    requests: list[Request],
    rows: list[int],
    kernel: SamplingKernel | None,
) -> None:
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = allocate_bitmask(len(rows), vocab)
    for k, row in enumerate(rows):
        grammar = requests[row].grammar
        assert grammar is not None
        grammar.fill(bitmask, k)
    if kernel is not None and logits.device.type == "cpu" and logits.is_contiguous():
        kernel.mask(logits, torch.tensor(rows), bitmask)
        return
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
    a negative one). Only the entries of tokens a row has seen are touched: a pass over the
    whole vocabulary per row cost more than the rest of the step at 64 rows."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    flat = logits.view(-1)
    chosen = [requests[i] for i in rows]
    starts = torch.tensor(rows) * vocab  # each row's first entry in `flat`, ascending

    def keys(ids_per_row: list[list[int]]) -> torch.Tensor:
        """row * vocab + token for every token of every row."""
        lengths = torch.tensor([len(ids) for ids in ids_per_row])
        tokens = torch.tensor([t for ids in ids_per_row for t in ids], dtype=torch.long)
        return torch.repeat_interleave(starts, lengths) + tokens

    def owners(entries: torch.Tensor) -> torch.Tensor:
        """The index in `chosen` of the row each entry of `flat` lies in."""
        return torch.searchsorted(starts, entries, right=True) - 1

    repetition = [r.params.repetition_penalty for r in chosen]
    if any(p != 1.0 for p in repetition):
        seen = torch.unique(keys([r.prompt_token_ids + r.output_token_ids for r in chosen]))
        factor = torch.tensor(repetition)[owners(seen)]
        seen, factor = seen.to(device), factor.to(device)
        values = flat[seen]
        penalized = torch.where(values > 0, values / factor, values * factor)
        # A factor near 0 (1e-300 is > 0) divides a logit past float's range: kept finite, so
        # that the row's logprobs stay numbers.
        flat[seen] = penalized.clamp(max=torch.finfo(flat.dtype).max)
    output, counts = torch.unique(keys([r.output_token_ids for r in chosen]), return_counts=True)
    if len(output):
        owner = owners(output)
        frequency = torch.tensor([r.params.frequency_penalty for r in chosen])[owner]
        presence = torch.tensor([r.params.presence_penalty for r in chosen])[owner]
        output = output.to(device)
        flat[output] -= (frequency * counts + presence).to(device)
