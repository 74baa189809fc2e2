"""Read a GGUF file into a Hugging Face config dictionary and tensors with HF names: fp32, or
(`packed=True`) the blocks of the formats our CPU kernel reads, as the file holds them."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bulletserve.model.quantized import PackedFormat, PackedPart
from bulletserve.model.source import ModelNotFoundError

log = logging.getLogger(__name__)

# GGUF architecture -> Hugging Face architecture class.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFError(ValueError):
    """The GGUF file cannot be read or holds something we do not support."""


def read_gguf(
    path: Path, packed: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor | PackedPart]]:
    """(the Hugging Face config, the tensors by Hugging Face name). Tensors are fp32, except,
    with `packed`, the matrices stored in a `PackedFormat`, kept as the file's blocks (read
    from its memory map)."""
    import gguf

    reader = _reader(path)
    config = _config(reader, path)
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor | PackedPart] = {}
    unpacked: dict[str, int] = {}
    for tensor in reader.tensors:
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            continue
        keep = packed and int(tensor.tensor_type) in PackedFormat._value2member_map_
        if keep:
            array = np.array(tensor.data, dtype=np.uint8)  # [rows, row bytes], a copy
        else:
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise GGUFError(
                    f"{path}: tensor {tensor.name} uses GGUF type {tensor.tensor_type.name}, "
                    "which the gguf package cannot dequantize"
                ) from None
            array = np.array(array, dtype=np.float32)  # a writable copy
            if packed and array.ndim == 2:
                name = tensor.tensor_type.name
                unpacked[name] = unpacked.get(name, 0) + 1
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp stores q/k rows interleaved for its RoPE kernel; undo it (whole rows,
            # so packed rows move as they are).
            n = heads if "q_proj" in hf_name else kv_heads
            array = _unpermute_rotary_rows(array, n)
        data = torch.from_numpy(array)
        if keep:
            format_ = PackedFormat(int(tensor.tensor_type))
            tensors[hf_name] = PackedPart(format_, data, int(tensor.shape[0]))
        else:
            tensors[hf_name] = data
    if unpacked:
        log.info(
            "%s: matrices of types our kernel does not read packed, dequantized at load: %s",
            path.name,
            ", ".join(f"{count} {name}" for name, count in sorted(unpacked.items())),
        )
    return config, tensors


def read_gguf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config of a GGUF file, from its metadata alone."""
    return _config(_reader(path), path)


def _config(reader: Any, path: Path) -> dict[str, Any]:
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(_ARCHITECTURES)}"
        )
    config = _hf_config(meta, arch, reader)
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    return config


def _reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise ModelNotFoundError(f"GGUF file {path} does not exist") from None
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from None


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_NAME.match(name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    if name == "rope_freqs.weight":
        return None  # recomputed from the rope scaling metadata
    raise GGUFError(f"unexpected GGUF tensor {name!r}")


def _hf_config(meta: dict[str, Any], arch: str, reader: Any) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": meta[f"{arch}.rope.scaling.factor"],
        }
    elif scaling_type not in (None, "none"):
        raise GGUFError(f"unsupported GGUF rope scaling {scaling_type!r}")
    return config


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value (strings decoded, arrays as lists)."""
    import gguf

    if not field.types:
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]
