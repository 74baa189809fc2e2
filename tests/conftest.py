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

from tests.tiny_models import GREEDY, make_hf_model, random_prompts, tiny_llm


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama with peaked logits (large init), so greedy choices have clear margins."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama", folder, seed=1, init_std=0.3)
    return folder


@pytest.fixture(scope="session")
def alone_outputs(tiny_llama_dir) -> list[list[int]]:
    """Greedy tokens of ten random prompts on the tiny Llama, one sequence a step: what any
    batching, policy or step order must reproduce."""
    llm = tiny_llm(tiny_llama_dir, max_num_seqs=1)
    return [o.token_ids for o in llm.generate(random_prompts(10, seed=5), GREEDY)]
