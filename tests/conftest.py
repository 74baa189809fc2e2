"""Shared fixtures: tiny random-weight models on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it is chosen when a
# kernel is defined, so before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import make_hf_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama with peaked logits (large init), so greedy choices have clear margins."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama", folder, seed=1, init_std=0.3)
    return folder
