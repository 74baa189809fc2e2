"""Turns logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds,
logprobs; before the draw, what rows ask of their logits (`engine.logits`: grammar, bans, bias,
penalties).

Everything runs where the logits are (a GPU sends back one id per row, not an [N, vocab]
matrix), in a few passes over the vocabulary and without sorting it: on a CPU, the earlier
softmax + full sort + float64 cumulative sum took 190 ms for 100 rows of a 128K vocabulary at
temperature 1 and 950 ms with top-p, more than an H200's whole decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bulletserve.engine.logits import process_logits, wants_processing
from bulletserve.engine.request import NO_TOKEN, Request, TokenLogprob
from bulletserve.model.cpu_kernels import sampling_kernel

# The inverse-CDF draw sums the vocabulary in blocks of this many entries, then walks one block.
CDF_BLOCK = 1024
# Top-p looks for its nucleus among this many most likely tokens first; a row whose nucleus
# is larger (a nearly flat distribution) falls back to sorting its whole vocabulary.
NUCLEUS_CANDIDATES = 1024


class Sampler:
    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        # On a CPU, rows at a temperature without top-k or top-p (and greedy rows) go through
        # our C kernel: two passes over a row where PyTorch's ops take five (None: off).
        self._kernel = sampling_kernel()

    def new_request_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, requests: list[Request], stop_ids: list[frozenset[int]]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row of `logits` ([N, V], on any device) for the matching request
        (`draw`, read back at once)."""
        return self.draw(logits, requests, stop_ids).read()

    @torch.inference_mode()
    def draw(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        stop_ids: list[frozenset[int]],
        proposals: list[Proposal | None] | None = None,
    ) -> Draw:
        """Draw one token per row of `logits` ([N, V], on any device) for the matching request,
        where the logits are; the host reads the tokens back later (`Draw.read`), so that a GPU
        may run the next step first. `logits` may be overwritten once this returns.

        `stop_ids[i]` are masked out while request i is below its `min_tokens` (not for a row
        held to a grammar, which decides itself when the output may end).

        `proposals[i]`: a draft token drawn from a distribution q of its own (speculative
        decoding's draft model at a random request's temperature), verified by rejection
        sampling: kept with probability min(1, p/q) at the row's distribution p, else a token
        drawn from max(p - q, 0) renormalized; the row's token is then distributed as p.
        """
        masked = [
            (row, ids)
            for row, (request, ids) in enumerate(zip(requests, stop_ids, strict=True))
            if len(request.output_token_ids) < request.params.min_tokens
            and ids
            and request.grammar is None
        ]
        processed = [row for row, request in enumerate(requests) if wants_processing(request)]
        on_kernel = self._kernel is not None and logits.device.type == "cpu"
        plain = all(r.params.greedy and r.params.logprobs is None for r in requests)
        if plain and not masked and not processed and not on_kernel:
            return Draw(logits.argmax(dim=-1))
        original = logits
        logits = logits.float()
        if (masked or processed) and logits.data_ptr() == original.data_ptr():
            logits = logits.clone()  # the caller's logits (a CUDA graph's output) stay intact
        for row, ids in masked:
            logits[row, list(ids)] = float("-inf")
        if processed:
            process_logits(logits, requests, processed, self._kernel)
        # One uniform per random row, from the request's own generator when it is seeded, so its
        # samples do not depend on its neighbours. (Noise over the whole vocabulary per row, as
        # an exponential race needs, cost 1.5 ms a row on a CPU.)
        uniforms = torch.zeros(len(requests), dtype=torch.float64)
        for row, request in enumerate(requests):
            if not request.params.greedy:
                uniforms[row : row + 1].uniform_(generator=request.generator or self._generator)
        vocab = logits.shape[-1]
        if on_kernel and not any(_filters(r, vocab) for r in requests):
            assert self._kernel is not None
            inverse = [0.0 if r.params.greedy else 1 / _temperature(r) for r in requests]
            tokens = self._kernel(logits.contiguous(), torch.tensor(inverse), uniforms)
            # Rows with a NaN or +inf logit, or every logit masked: PyTorch's path.
            redo = (tokens < 0).nonzero().flatten().tolist()
            if redo:
                tokens[redo] = _drawn(logits[redo], [requests[i] for i in redo], uniforms[redo])
        else:
            tokens = _drawn(logits, requests, uniforms.to(logits.device))
        checked = [row for row, proposal in enumerate(proposals or ()) if proposal is not None]
        if checked:
            assert proposals is not None
            _verify_proposals(
                logits, requests, tokens, uniforms, checked, proposals, self._generator
            )
        draw = Draw(tokens, _logprobs(logits, requests, tokens))
        if processed:
            # Only a row with every logit masked draws a token whose logit is -inf.
            rows = torch.tensor(processed, device=logits.device)
            draw.unsatisfiable = rows[torch.isneginf(logits[rows, tokens[rows]])]
        return draw


@dataclass(frozen=True)
class Proposal:
    """A draft token and the distribution it was drawn from (`q`: [V] probabilities, on the
    logits' device)."""

    token: int
    q: torch.Tensor


def _verify_proposals(
    logits: torch.Tensor,
    requests: list[Request],
    tokens: torch.Tensor,
    uniforms: torch.Tensor,
    rows: list[int],
    proposals: list[Proposal | None],
    generator: torch.Generator,
) -> None:
    """Rejection sampling for the random rows of `rows` (a greedy one keeps its argmax, which
    is p's one token): each row's own uniform decides min(1, p/q) at its draft; a rejected row
    draws again from max(p - q, 0), with a second uniform from its request's generator."""
    rows = [row for row in rows if not requests[row].params.greedy]
    if not rows:
        return
    device = logits.device
    index = torch.tensor(rows, device=device)
    chosen = [requests[row] for row in rows]
    maxima = logits[index].max(dim=-1).values
    weights = _filtered_weights(logits[index], maxima, chosen).double()
    p = weights / weights.sum(dim=-1, keepdim=True)
    q = torch.stack([proposals[row].q for row in rows]).to(device=device, dtype=torch.float64)
    drafts = torch.tensor([proposals[row].token for row in rows], device=device)
    at = drafts.unsqueeze(1)
    accepted = uniforms[rows].to(device) * q.gather(1, at).squeeze(1) < p.gather(1, at).squeeze(1)
    residual = (p - q).clamp_(min=0)
    # Where p is q itself nothing is left to draw from, and every draft was kept.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    again = torch.zeros(len(rows), 1, dtype=torch.float64)
    for k, request in enumerate(chosen):
        again[k].uniform_(generator=request.generator or generator)
    redrawn = _inverse_cdf(residual, again.to(device))
    tokens[index] = torch.where(accepted, drafts, redrawn)


@dataclass
class LogprobRows:
    """The logprobs of a draw's rows that asked for them, where the logits are: each row's
    sampled token's and its `most` best (for `wanted[i]` of them)."""

    rows: list[int]
    wanted: list[int]
    chosen: torch.Tensor  # [rows]
    top_values: torch.Tensor | None  # [rows, most]
    top_ids: torch.Tensor | None


@dataclass
class Draw:
    """A step's drawn tokens, where the logits were, until the host reads them back."""

    tokens: torch.Tensor  # [rows]
    logprobs: LogprobRows | None = None
    unsatisfiable: torch.Tensor | None = None  # rows whose constraints left no token
    # On a GPU, after `copy_back`: the same in pinned host memory, and the event after the copy.
    on_host: Draw | None = None
    copied: torch.cuda.Event | None = None

    def copy_back(self) -> None:
        """On a GPU, start copying the draw to the host behind the kernels that drew it, so
        that `read` waits for this draw alone, not for the steps launched after it; `tokens`
        stay on the device, for the next step to take its inputs from."""
        if self.tokens.device.type != "cuda":
            return
        asked = self.logprobs
        self.on_host = Draw(
            _pinned_copy(self.tokens),
            None
            if asked is None
            else LogprobRows(
                asked.rows,
                asked.wanted,
                _pinned_copy(asked.chosen),
                None if asked.top_values is None else _pinned_copy(asked.top_values),
                None if asked.top_ids is None else _pinned_copy(asked.top_ids),
            ),
            None if self.unsatisfiable is None else _pinned_copy(self.unsatisfiable),
        )
        self.copied = torch.cuda.Event()
        self.copied.record()

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens on the host (waiting for the device where they are not there yet), and
        each row's logprobs where it asked for them."""
        if self.on_host is not None:
            assert self.copied is not None
            self.copied.synchronize()
            return self.on_host.read()
        token_list = self.tokens.tolist()
        results: list[TokenLogprob | None] = [None] * len(token_list)
        if self.logprobs is not None:
            asked = self.logprobs
            chosen = asked.chosen.tolist()
            values = asked.top_values.tolist() if asked.top_values is not None else None
            ids = asked.top_ids.tolist() if asked.top_ids is not None else None
            for k, (row, wanted) in enumerate(zip(asked.rows, asked.wanted, strict=True)):
                top = list(zip(ids[k][:wanted], values[k][:wanted], strict=True)) if wanted else []
                results[row] = TokenLogprob(token_list[row], chosen[k], top)
        if self.unsatisfiable is not None:
            for row in self.unsatisfiable.tolist():
                token_list[row] = NO_TOKEN
        return token_list, results


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _filters(request: Request, vocab: int) -> bool:
    """Whether a request's draw is cut to a top-k, a top-p nucleus or a min-p floor."""
    params = request.params
    return not params.greedy and (0 < params.top_k < vocab or params.top_p < 1 or params.min_p > 0)


def _temperature(request: Request) -> float:
    # A temperature below float32's smallest normal number would be 0, and the maximum's 0/0 a
    # NaN; held at it, every other weight is 0 and the draw is the argmax, the limit as the
    # temperature goes to 0.
    return max(request.params.temperature, torch.finfo(torch.float32).tiny)


def _drawn(logits: torch.Tensor, requests: list[Request], uniforms: torch.Tensor) -> torch.Tensor:
    """The argmax of greedy rows and the inverse-CDF draw of the others at `uniforms` (one per
    row), through PyTorch's ops."""
    maxima, tokens = logits.max(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        chosen = [requests[i] for i in random_rows]
        if len(random_rows) == len(requests):
            rows = slice(None)  # every row: no copy of the [N, vocab] logits
        else:
            rows = torch.tensor(random_rows, device=logits.device)
        weights = _filtered_weights(logits[rows], maxima[rows], chosen)
        drawn = _inverse_cdf(weights, uniforms[rows].unsqueeze(1))
        # A row whose largest logit is not finite (NaN, or everything masked) has no
        # distribution to draw from: it keeps its argmax.
        tokens[rows] = torch.where(torch.isfinite(maxima[rows]), drawn, tokens[rows])
    return tokens


def _filtered_weights(
    logits: torch.Tensor, maxima: torch.Tensor, requests: list[Request]
) -> torch.Tensor:
    """exp((logit - max) / temperature) per row, zeroed outside its top-k, below its min-p and
    outside its top-p nucleus: unnormalized probabilities whose largest entry is 1 (so min-p's
    floor, a share of the likeliest token's probability, is min_p itself). Subtracting the
    maximum first keeps every entry within [0, 1] however small the temperature."""
    device = logits.device
    temperature = torch.tensor([_temperature(r) for r in requests], device=device)
    weights = (logits - maxima.unsqueeze(1)).div_(temperature.unsqueeze(1)).exp_()
    vocab = weights.shape[-1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in requests]
    if any(top_k):
        largest = weights.topk(max(top_k), dim=-1).values
        at = torch.tensor([max(k, 1) - 1 for k in top_k], device=device).unsqueeze(1)
        threshold = largest.gather(1, at)
        threshold[torch.tensor([k == 0 for k in top_k], device=device)] = 0
        # Ties with the k-th largest weight stay in (a threshold, not a rank).
        weights.masked_fill_(weights < threshold, 0)
    min_p = [r.params.min_p for r in requests]
    if any(min_p):
        weights.masked_fill_(weights < torch.tensor(min_p, device=device).unsqueeze(1), 0)
    top_p = [r.params.top_p for r in requests]
    if any(p < 1 for p in top_p):
        weights.masked_fill_(weights < _nucleus_threshold(weights, top_p), 0)
    return weights


def _nucleus_threshold(weights: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Per row, the smallest weight in the smallest set of largest weights whose share of the
    row's total reaches top_p (0 where top_p >= 1): keeping weights >= it keeps the nucleus."""
    device = weights.device
    p = torch.tensor(top_p, device=device, dtype=torch.float64).unsqueeze(1)
    total = weights.sum(dim=-1, keepdim=True, dtype=torch.float64)
    candidates = min(NUCLEUS_CANDIDATES, weights.shape[-1])
    largest = weights.topk(candidates, dim=-1).values
    threshold, complete = _cutoff(largest, total, p)
    for row in (~complete).nonzero().flatten().tolist():
        every = weights[row : row + 1].sort(dim=-1, descending=True).values
        threshold[row] = _cutoff(every, total[row : row + 1], p[row : row + 1])[0]
    return threshold.masked_fill_(p >= 1, 0)


def _cutoff(
    descending: torch.Tensor, total: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the nucleus's smallest weight per row, whether the nucleus ends among these weights:
    the largest of a row's weights, in descending order, against its total)."""
    cumulative = descending.double().cumsum(dim=-1)
    mass_before = (cumulative - descending) / total
    # The first weight always stays; keep each next one while the mass before it is below p.
    count = (mass_before < p).sum(dim=-1, keepdim=True).clamp_(min=1)
    complete = (count < descending.shape[-1]) | (cumulative[:, -1:] / total >= p)
    return descending.gather(1, count - 1), complete.squeeze(1)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds u * total: a draw from the
    row's distribution that never lands on a zero-weight entry. The running sum is taken over
    blocks of CDF_BLOCK entries, then inside the one block the draw falls in."""
    rows, vocab = weights.shape
    full = vocab // CDF_BLOCK
    sums = [weights[:, : full * CDF_BLOCK].view(rows, full, CDF_BLOCK).sum(dim=-1)]
    if vocab > full * CDF_BLOCK:
        sums.append(weights[:, full * CDF_BLOCK :].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=1).double().cumsum(dim=-1)
    total = block_cdf[:, -1:].contiguous()
    target = uniforms * total
    block = _first_above(block_cdf, target, total)
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0)
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=weights.device)
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0)
    inside_cdf = inside.double().cumsum(dim=-1)
    offset = _first_above(inside_cdf, target - before, inside_cdf[:, -1:].contiguous())
    return (block * CDF_BLOCK + offset).clamp_(max=vocab - 1).squeeze(1)


def _first_above(cdf: torch.Tensor, target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative value exceeds `target`. A target that rounds
    up to the total (or past it) takes the last entry with any mass instead; a row without
    finite mass still yields an index inside the row."""
    picks = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, total)
    return torch.minimum(picks, last).clamp_(max=cdf.shape[-1] - 1)


def _logprobs(
    logits: torch.Tensor, requests: list[Request], tokens: torch.Tensor
) -> LogprobRows | None:
    """The sampled token's logprob and the top alternatives, for the rows that asked."""
    asked = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not asked:
        return None
    wanted = [requests[i].params.logprobs or 0 for i in asked]
    index = torch.tensor(asked, device=logits.device)
    logprobs = torch.log_softmax(logits[index], dim=-1)
    chosen = logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1)
    most = max(wanted)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most > 0 else (None, None)
    return LogprobRows(asked, wanted, chosen, top_values, top_ids)
