"""Padded decode batches (what a decode graph captures) on the CPU, through our Triton decode
kernel in Triton's interpreter: the padding rows change no real row's logits and leave the cache
finite, and one bucket's inputs serve every context length. Capture and replay themselves run in
tests/test_cuda.py, where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.cuda_graphs import PaddedDecode, batch_buckets, bucket, padded_forward
from bulletserve.engine.engine import LLMEngine
from bulletserve.engine.model_runner import ModelRunner, SeqWork
from bulletserve.kv.pool import KVPool
from bulletserve.model.loader import load_model
from bulletserve.model.source import resolve_model
from bulletserve.model.triton_attention import TritonDecodeAttention
from tests.tiny_models import random_prompts


def test_buckets():
    assert bucket(1, (1, 2, 4)) == 1 and bucket(3, (1, 2, 4)) == 4 and bucket(5, (1, 2, 4)) is None
    assert batch_buckets(256)[-1] == 256 and batch_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert batch_buckets(300)[-1] == 300


def test_no_graphs_off_cuda():
    engine = LLMEngine(EngineConfig(model="tiny", load_format="dummy", device="cpu"))
    assert engine.runner.graphs is None


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton runs on CUDA there: tests/test_cuda.py replays"
)
def test_triton_padded_decode_matches_the_unpadded_step(tiny_llama_dir):
    model = load_model(resolve_model(str(tiny_llama_dir)), torch.float32, torch.device("cpu"), 256)
    pool = KVPool(model.config, 64, 16, torch.float32, torch.device("cpu"))
    pool.kv[:, :, 16:].fill_(float("nan"))  # stale memory: only written slots may be read
    runner = ModelRunner(model, pool, torch.device("cpu"))
    config = model.config
    kernel = TritonDecodeAttention(config.head_dim, config.num_heads // config.num_kv_heads, 8)
    runner.decode_kernel = kernel  # the CUDA path's attention
    prompts = random_prompts(3, seed=7, low=5, high=40)
    works = []
    for prompt in prompts:
        blocks = pool.allocator.allocate(-(-(len(prompt) + 2) // 16))
        runner.execute([SeqWork(prompt, 0, blocks, samples=True)])
        works.append(SeqWork([prompt[-1] % 97 + 3], len(prompt), blocks, samples=True))
    eager, order = runner.execute(works)
    assert order == [0, 1, 2]
    inputs = PaddedDecode.allocate(8, 256 // 16, torch.device("cpu"))  # 5 padding rows
    inputs.block_tables.fill_(5)  # stale ids past every context are never read
    inputs.fill(works, pool.block_size)
    padded = padded_forward(model, pool, inputs, kernel)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(padded).all()
    assert torch.isfinite(pool.kv[:, :, :16]).all()  # what the padding rows wrote: finite
    # The same inputs, one token later: contexts grow, the bucket stays.
    later = [SeqWork([7], w.start + 1, w.block_table, samples=True) for w in works]
    inputs.fill(later, pool.block_size)
    again = padded_forward(model, pool, inputs, kernel)
    expected, _ = runner.execute(later)
    torch.testing.assert_close(again[:3], expected, rtol=1e-4, atol=1e-4)
