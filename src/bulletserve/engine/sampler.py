"""Turns logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from bulletserve.engine.request import Request, TokenLogprob


class Sampler:
    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def new_request_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, requests: list[Request], stop_ids: list[frozenset[int]]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row of `logits` ([N, V], fp32 on any device) for the matching request.

        `stop_ids[i]` are masked out while request i is below its `min_tokens`.
        """
        masked = [
            (row, ids)
            for row, (request, ids) in enumerate(zip(requests, stop_ids, strict=True))
            if len(request.output_token_ids) < request.params.min_tokens and ids
        ]
        plain = all(r.params.greedy and r.params.logprobs is None for r in requests)
        if plain and not masked:
            # Greedy rows need only their argmax: taken where the logits are, so a GPU sends
            # back one id per row instead of the whole [N, vocab] matrix.
            return logits.argmax(dim=-1).tolist(), [None] * len(requests)
        logits = logits.float().cpu()
        for row, ids in masked:
            logits[row, list(ids)] = float("-inf")
        logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            probs = self._filtered_probs(logits[rows], [requests[i] for i in random_rows])
            # Inverse-CDF draw: one uniform per row, from the request's own generator when it
            # is seeded, so its samples do not depend on its neighbours. (Noise over the whole
            # vocabulary per row, as an exponential race needs, cost 1.5 ms a row on a CPU.)
            uniforms = torch.empty(len(random_rows), 1, dtype=torch.float64)
            for k, i in enumerate(random_rows):
                uniforms[k].uniform_(generator=requests[i].generator or self._generator)
            drawn = _inverse_cdf(probs, uniforms)
            # A temperature so small that the scaled logits overflow leaves no finite mass: take
            # the argmax, the limit of sampling as the temperature goes to 0.
            finite = torch.isfinite(probs).all(dim=-1)
            tokens[rows] = torch.where(finite, drawn, tokens[rows])
        token_list = tokens.tolist()
        results: list[TokenLogprob | None] = []
        for row, request in enumerate(requests):
            if logprobs is None or request.params.logprobs is None:
                results.append(None)
                continue
            top = []
            if request.params.logprobs > 0:
                values, ids = logprobs[row].topk(request.params.logprobs)
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            token = token_list[row]
            results.append(TokenLogprob(token, float(logprobs[row, token]), top))
        return token_list, results

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temperature = torch.tensor([r.params.temperature for r in requests]).unsqueeze(1)
        logits = logits / temperature
        top_k = [r.params.top_k for r in requests]
        top_p = [r.params.top_p for r in requests]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            k = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
            ranks = torch.arange(vocab).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            p = torch.tensor(top_p).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return logits.softmax(dim=-1)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative probability exceeds u * total: a draw from
    the row's distribution that never lands on a zero-probability entry."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    picks = torch.searchsorted(cdf, uniforms * total, right=True)
    # u * total can round up to total itself: take the last entry with any mass instead. A row
    # without finite mass (logits that overflowed to inf give NaN) still yields a valid id.
    last = torch.searchsorted(cdf, total)
    return torch.minimum(picks, last).clamp_(max=probs.shape[-1] - 1).squeeze(1)
