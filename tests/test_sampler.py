"""The sampler's random draw: frequencies follow the distribution, zero mass is never drawn,
and temperature, top-k and top-p give the distribution a full sort would."""

from __future__ import annotations

import pytest
import torch

from bulletserve.engine.request import Request, RequestTimings
from bulletserve.engine.sampler import (
    CDF_BLOCK,
    NUCLEUS_CANDIDATES,
    Proposal,
    Sampler,
    _filtered_weights,
    _inverse_cdf,
)
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.engine.structured import disallowed
from bulletserve.model.cpu_kernels import sampling_kernel


def test_draws_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]])
    n = 40_000
    uniforms = torch.rand(n, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    picks = _inverse_cdf(probs.expand(n, -1), uniforms)
    freq = torch.bincount(picks, minlength=5).double() / n
    assert freq[1] == 0 and freq[4] == 0
    # Four standard deviations of a binomial frequency at n = 40000 is at most 0.01.
    assert torch.allclose(freq, probs[0].double(), atol=0.01)


def test_unnormalized_rows_and_the_ends_of_the_unit_interval():
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for u, expected in ((0.0, [1, 0]), (0.25 - 1e-9, [1, 0]), (0.25, [3, 0]), (1.0, [3, 0])):
        uniforms = torch.full((2, 1), u, dtype=torch.float64)
        assert _inverse_cdf(probs, uniforms).tolist() == expected


def test_a_row_without_finite_mass_still_gives_a_valid_id():
    probs = torch.tensor([[float("nan")] * 4, [0.0, 1.0, 0.0, 0.0]])
    picks = _inverse_cdf(probs, torch.full((2, 1), 0.5, dtype=torch.float64))
    assert 0 <= picks[0] < 4 and picks[1] == 1


def test_draws_across_blocks_and_the_partial_last_block():
    vocab = 2 * CDF_BLOCK + 37
    weights = torch.zeros(1, vocab)
    heavy = {5: 0.2, CDF_BLOCK + 3: 0.3, 2 * CDF_BLOCK + 36: 0.5}  # the last id of the vocab
    for index, weight in heavy.items():
        weights[0, index] = weight
    n = 40_000
    uniforms = torch.rand(n, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    picks = _inverse_cdf(weights.expand(n, -1).contiguous(), uniforms)
    freq = torch.bincount(picks, minlength=vocab).double() / n
    assert set(picks.unique().tolist()) == set(heavy)
    for index, weight in heavy.items():
        assert abs(freq[index] - weight) < 0.01
    ends = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    assert _inverse_cdf(weights.expand(2, -1).contiguous(), ends).tolist() == [5, vocab - 1]


def _request(**params) -> Request:
    return Request("r", None, [1], SamplingParams(max_tokens=1, **params), RequestTimings(0.0))


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Temperature, top-k and top-p by a full sort, the textbook way."""
    scaled = logits.double() / temperature
    ordered, order = scaled.sort(descending=True)
    if top_k > 0:
        ordered[top_k:] = float("-inf")
    probs = ordered.softmax(dim=-1)
    keep = (probs.cumsum(dim=-1) - probs) < top_p
    ordered[~keep] = float("-inf")
    return torch.full_like(scaled, float("-inf")).scatter(0, order, ordered).softmax(dim=-1)


@pytest.mark.parametrize(
    ("scale", "temperature", "top_k", "top_p"),
    [
        (3.0, 1.0, 0, 1.0),
        (3.0, 0.7, 0, 0.9),
        (3.0, 1.3, 50, 1.0),
        (3.0, 0.8, 200, 0.5),
        (0.05, 1.0, 0, 0.95),  # nearly flat: the nucleus outgrows the candidates, full sort
    ],
)
def test_filtered_weights_match_a_full_sort(scale, temperature, top_k, top_p):
    vocab = 5000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * scale
    request = _request(temperature=temperature, top_k=top_k, top_p=top_p)
    weights = _filtered_weights(logits.unsqueeze(0), logits.max().unsqueeze(0), [request])[0]
    expected = _reference_probs(logits, temperature, top_k, top_p)
    assert torch.equal(weights > 0, expected > 0)
    assert torch.allclose((weights / weights.sum()).double(), expected, atol=1e-6)
    if scale < 1:
        assert int((expected > 0).sum()) > NUCLEUS_CANDIDATES


def test_random_rows_sample_from_their_filtered_distribution():
    """Rows of one batch keep their own settings: greedy, top-k 2, and top-p over a peak."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0], [9.0, 0.0, 0.0, 0.0]])
    requests = [_request(temperature=0), _request(top_k=2), _request(top_p=0.5)]
    sampler = Sampler(seed=0)
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(200):
        tokens, _ = sampler.sample(logits, requests, [frozenset()] * 3)
        for row, token in enumerate(tokens):
            seen[row].add(token)
    assert seen == [{1}, {1, 2}, {0}]


kernel = sampling_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler for our CPU kernels")


@needs_kernel
def test_the_kernels_draws_follow_the_tempered_distribution():
    logits = torch.tensor([1.0, -2.0, 0.5, 2.0, -float(30)])
    n, temperature = 40_000, 0.7
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    inverse = torch.full((n,), 1 / temperature)
    picks = kernel(logits.expand(n, -1).contiguous(), inverse, uniforms)
    freq = torch.bincount(picks, minlength=5).double() / n
    assert torch.allclose(freq, (logits.double() / temperature).softmax(-1), atol=0.01)


@needs_kernel
def test_the_kernel_draws_as_the_pytorch_path_across_blocks():
    vocab = 3 * CDF_BLOCK + 101
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(4)) * 4
    uniforms = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    uniforms[:2] = torch.tensor([0.0, 1.0], dtype=torch.float64)
    weights = (logits - logits.max(-1, keepdim=True).values).exp()
    expected = _inverse_cdf(weights, uniforms.unsqueeze(1))
    drawn = kernel(logits, torch.ones(64), uniforms)
    # The same draw but where exp's last bits put a uniform on the other side of a boundary.
    assert (drawn == expected).float().mean() > 0.95
    assert drawn[:2].tolist() == expected[:2].tolist()
    assert drawn.min() >= 0 and drawn.max() < vocab


@needs_kernel
def test_the_kernels_argmax_takes_the_first_of_ties_and_refuses_non_finite_rows():
    """NaN or +inf refuses a row, and so does a row masked whole; a -inf entry is masked."""
    inf = float("inf")
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, 0.0, 3.0, 0.0]])
    bad = torch.tensor([[0.0, float("nan"), 1.0, 0.0], [0.0, inf, 1.0, 0.0], [-inf] * 4])
    rows = torch.cat([logits, bad])
    tokens = kernel(rows, torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]), torch.full((5,), 0.5))
    assert tokens.tolist() == [1, 0, -1, -1, -1]


@needs_kernel
@pytest.mark.parametrize("temperature", [0.0, 1e-30, 0.3, 1.0, 50.0])
def test_the_kernel_never_draws_a_masked_entry(temperature):
    """-inf entries (a grammar's mask, written by the kernel's own mask) have no mass at any
    temperature, even where they were the likeliest."""
    vocab = 3 * CDF_BLOCK + 5
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(3)) * 4
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, -(-vocab // 32)), dtype=torch.int32)
    bitmask[:, 0] = 1  # token 0 allowed in every row: no row is masked whole
    logits[:, 1] = 100.0  # the likeliest, and masked
    kernel.mask(logits, torch.arange(64), bitmask)
    allowed = ~disallowed(bitmask, vocab)
    assert torch.isinf(logits[~allowed]).all() and torch.isfinite(logits[allowed]).all()
    inverse = torch.full((64,), 0.0 if temperature == 0 else 1 / temperature)
    for seed in range(3):
        uniforms = torch.rand(
            64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
        )
        tokens = kernel(logits, inverse, uniforms)
        assert (tokens >= 0).all() and allowed[torch.arange(64), tokens].all()


@needs_kernel
def test_the_sampler_masks_stop_ids_below_min_tokens_beside_free_rows():
    """A request below min_tokens has its stop ids at -inf: never drawn; the other rows keep
    them."""
    logits = torch.tensor([[0.0, 9.0, 0.0, 0.0], [0.0, 9.0, 0.0, 0.0]])
    held = _request(temperature=0, min_tokens=1)
    free = _request(temperature=0)
    tokens, _ = Sampler(seed=0).sample(logits, [held, free], [frozenset({1})] * 2)
    assert tokens[0] != 1 and tokens[1] == 1


def test_rejection_sampling_of_drafts_keeps_the_targets_distribution():
    """Drafts drawn from a distribution q of their own, each verified by min(1, p/q) and a
    rejected one redrawn from max(p - q, 0): the tokens are distributed as the target's p (the
    processed one: temperature, top-k), their distance to it shrinking with their number as
    vLLM's rejection sampler test has it; drafts are kept at the rate sum(min(p, q))."""
    settings = {"top_k": 3, "temperature": 0.7}
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, generator=generator) * 2
    q = torch.softmax(torch.randn(6, generator=generator), dim=-1)
    p = _reference_probs(logits, settings["temperature"], settings.get("top_k", 0), 1.0)
    sampler = Sampler(seed=5)
    distances = []
    for n in (200, 2_000, 16_000):
        drafts = torch.multinomial(q, n, replacement=True, generator=generator)
        requests = [_request(**settings) for _ in range(n)]
        proposals = [Proposal(int(d), q) for d in drafts]
        tokens, _ = sampler.draw(
            logits.expand(n, -1).clone(), requests, [frozenset()] * n, proposals
        ).read()
        tokens = torch.tensor(tokens)
        frequency = torch.bincount(tokens, minlength=6).double() / n
        distances.append(0.5 * (frequency - p).abs().sum().item())
        kept = (tokens == drafts).double().mean().item()
    assert distances[2] < distances[0] and distances[2] < 0.02
    assert abs(kept - torch.minimum(p, q.double()).sum().item()) < 0.02
