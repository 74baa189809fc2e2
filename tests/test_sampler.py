"""The sampler's random draw: frequencies follow the distribution, zero mass is never drawn."""

from __future__ import annotations

import torch

from bulletserve.engine.sampler import _inverse_cdf


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
