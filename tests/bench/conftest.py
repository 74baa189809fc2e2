"""The default model's tokenizer, for workloads built under it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from bulletserve.model.tokenizer import load_tokenizer

    return load_tokenizer(None)
