"""A lane's logits in memory reused from step to step: the same values as a fresh fp32 tensor."""

from __future__ import annotations

import torch

from bulletserve.model.decoder import LogitsBuffer


def test_logits_convert_exactly_into_reused_memory():
    buffer = LogitsBuffer()
    small = torch.randn(3, 50).to(torch.bfloat16)
    first = buffer.fp32(small)
    assert first.dtype == torch.float32 and torch.equal(first, small.float())
    large = torch.randn(8, 50).to(torch.bfloat16)
    grown = buffer.fp32(large)
    assert torch.equal(grown, large.float())
    again = buffer.fp32(small)  # fits: the grown memory again, not a new allocation
    assert again.data_ptr() == grown.data_ptr() and torch.equal(again, small.float())
    special = torch.tensor(
        [[float("nan"), float("inf"), -float("inf"), -0.0]], dtype=torch.bfloat16
    )
    converted = buffer.fp32(special)
    assert torch.isnan(converted[0, 0]) and converted[0, 1:].tolist() == [
        float("inf"),
        -float("inf"),
        0.0,
    ]
    assert torch.signbit(converted[0, 3])
