"""Padded decode batches (what `--cuda-graphs` captures) on the CPU: the padding rows change no
real row's logits and leave the cache finite. Capture and replay themselves run in
tests/test_cuda.py, where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.cuda_graphs import (
    PaddedDecode,
    bucket,
    context_buckets,
    padded_forward,
)
from bulletserve.engine.engine import LLMEngine
from bulletserve.engine.runner import ModelRunner, SeqWork
from bulletserve.kv.pool import KVPool
from bulletserve.model.loader import load_model
from bulletserve.model.source import resolve_model
from tests.tiny_models import random_prompts


def test_buckets():
    assert bucket(1, (1, 2, 4)) == 1 and bucket(3, (1, 2, 4)) == 4 and bucket(5, (1, 2, 4)) is None
    assert context_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert context_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert context_buckets(100) == (100,)


def test_cuda_graphs_need_a_gpu():
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):
        LLMEngine(EngineConfig(model="tiny", load_format="dummy", device="cpu", cuda_graphs=True))


def test_padded_decode_matches_the_unpadded_step(tiny_llama_dir):
    model = load_model(resolve_model(str(tiny_llama_dir)), torch.float32, torch.device("cpu"), 256)
    pool = KVPool(model.config, 64, 16, torch.float32, torch.device("cpu"))
    pool.kv[:, :, 16:].fill_(float("nan"))  # stale memory: only written slots may be read
    runner = ModelRunner(model, pool, torch.device("cpu"))
    runner.decode_kernel = None  # the SDPA path, as on a GPU
    prompts = random_prompts(3, seed=7, low=5, high=40)
    works = []
    for prompt in prompts:
        blocks = pool.allocator.allocate(-(-(len(prompt) + 1) // 16))
        runner.execute([SeqWork(prompt, 0, blocks, samples=True)])
        works.append(SeqWork([prompt[-1] % 97 + 3], len(prompt), blocks, samples=True))
    eager, order = runner.execute(works)
    assert order == [0, 1, 2]
    inputs = PaddedDecode.allocate(8, 256, torch.device("cpu"))  # 5 padding rows, wide context
    inputs.fill(works, pool.block_size)
    padded = padded_forward(model, pool, inputs)
    # 8 rows against 3 and attention over 256 masked slots against the exact context sum in other
    # orders: up to 2.5e-5 apart in fp32 with AVX2 kernels (AMD Zen 3), 1e-5 with AVX-512 ones.
    torch.testing.assert_close(padded[:3], eager, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(padded).all()
    assert torch.isfinite(pool.kv[:, :, :16]).all()  # what the padding rows wrote: finite
    again, _ = runner.execute(works)  # the null block's new contents change nothing
    torch.testing.assert_close(again, eager, rtol=1e-5, atol=1e-5)
