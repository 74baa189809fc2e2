"""Named model shapes for `--load-format dummy`: random weights of the real shape.

Shapes are copied from each model's published `config.json` on the Hugging Face Hub
(meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B, Qwen/Qwen3-8B,
HuggingFaceTB/SmolLM2-135M-Instruct). `tiny` is ours, for tests.
"""

from __future__ import annotations

from dataclasses import replace

from bulletserve.model.config import ModelConfig, RopeScaling

_LLAMA31_ROPE = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

_LLAMA31_8B = ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_LLAMA31_ROPE,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)

PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": _LLAMA31_8B,
    "llama-3.1-70b": replace(
        _LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64
    ),
    "qwen3-8b": ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        qk_norm=True,
        eos_token_ids=(151645,),
    ),
    "smollm2-135m": ModelConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}
# Ours, for tests: SmolLM2's vocabulary and special tokens (so its tokenizer fits) on a toy shape.
PRESETS["tiny"] = replace(
    PRESETS["smollm2-135m"],
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10000.0,
)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r} for --load-format dummy; known: {', '.join(PRESETS)}"
        ) from None
