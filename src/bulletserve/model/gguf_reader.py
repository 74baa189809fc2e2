"""Read a GGUF file into a Hugging Face config dictionary and tensors with HF names: fp32, or
(`packed=True`) the blocks of the formats our CPU kernel reads, as the file holds them."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bulletserve.model.checks import check_shapes
from bulletserve.model.config import ModelConfig
from bulletserve.model.file_error import ModelFileError
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

    reader = _reader(path, last_use=True)
    config = _config(reader, path)
    _check(reader, config, path)
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


def check_tokenizer_fields(path: Path) -> None:
    """GGUFError naming the metadata a tokenizer is built from where the file lacks it (the
    vocabulary, and its merges or its scores), before transformers reads it."""
    fields = _reader(path).fields
    missing = [
        key for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if key not in fields
    ]
    if not missing and "tokenizer.ggml.merges" not in fields:
        if "tokenizer.ggml.scores" not in fields:
            missing.append("tokenizer.ggml.merges (or tokenizer.ggml.scores)")
    if missing:
        raise GGUFError(
            f"{path}: the tokenizer's metadata lacks {', '.join(missing)}; --tokenizer names "
            "a tokenizer folder to use instead"
        )


def checked_config(path: Path) -> tuple[dict[str, Any], ModelConfig]:
    """The file's Hugging Face config and the model config from it, each value and every
    tensor's shape (from the file's header: no weight is read) checked against it."""
    reader = _reader(path)
    config = _config(reader, path)
    return config, _check(reader, config, path)


def _check(reader: Any, config: dict[str, Any], path: Path) -> ModelConfig:
    """ModelFileError naming the file and the GGUF key or tensor where the metadata's values
    or a tensor's shape are wrong."""
    try:
        model_config = ModelConfig.from_hf_dict(config)
        shapes = {}
        for tensor in reader.tensors:
            hf_name = _hf_name(tensor.name)
            if hf_name is not None:
                # GGUF lists dimensions innermost first: [columns, rows].
                shapes[hf_name] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        check_shapes(model_config, shapes)
    except ModelFileError as exc:
        names = {exc.what: gguf_tensor_name(exc.what)} | config_keys(config["model_type"])
        raise exc.in_file(path, names) from None
    return model_config


# The gguf package parses a file's metadata in Python: 2-4 s for a 49K-token vocabulary. A
# load that checks a file's config and tokenizer fields and then reads its tensors parses it
# once: the last file's reader is kept until its tensors are read (`last_use`), so that its
# memory map does not outlive the load.
_kept_reader: tuple[tuple[str, int, int], Any] | None = None
_kept_lock = threading.Lock()


def _reader(path: Path, last_use: bool = False) -> Any:
    import gguf

    global _kept_reader
    try:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        with _kept_lock:
            kept, _kept_reader = _kept_reader, None
        reader = kept[1] if kept is not None and kept[0] == key else gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise ModelNotFoundError(f"GGUF file {path} does not exist") from None
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from None
    if not last_use:
        with _kept_lock:
            _kept_reader = (key, reader)
    return reader


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

    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = meta.get(f"{arch}.vocab_size", len(tokens))
    if isinstance(vocab, int) and len(tokens) > vocab:
        raise GGUFError(
            f"tokenizer.ggml.tokens holds {len(tokens)} tokens, more than {arch}.vocab_size {vocab}"
        )
    # Values as the file holds them: ModelConfig checks them, naming the keys (`config_keys`).
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv"),
        "head_dim": meta.get(f"{arch}.attention.key_length"),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": get("rope.scaling.factor"),
        }
    elif scaling_type not in (None, "none"):
        raise GGUFError(f"unsupported GGUF rope scaling {scaling_type!r}")
    return config


def config_keys(arch: str) -> dict[str, str]:
    """Hugging Face config key -> the GGUF metadata key it is read from, for messages."""
    keys = {
        "vocab_size": "vocab_size",
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "head_dim": "attention.key_length",
        "max_position_embeddings": "context_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "rope_theta": "rope.freq_base",
        "rope_scaling.factor": "rope.scaling.factor",
    }
    return {
        **{hf: f"{arch}.{key}" for hf, key in keys.items()},
        "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_id": "tokenizer.ggml.eos_token_id",
        "pad_token_id": "tokenizer.ggml.padding_token_id",
    }


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF file's name of a tensor read under `hf_name` (itself where none maps)."""
    if hf_name in _HF_GLOBAL:
        return _HF_GLOBAL[hf_name]
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if match and match.group(2) in _HF_LAYER:
        return f"blk.{match.group(1)}.{_HF_LAYER[match.group(2)]}"
    return hf_name


_HF_GLOBAL = {hf: gguf for gguf, hf in _GLOBAL_TENSORS.items()}
_HF_LAYER = {hf: gguf for gguf, hf in _LAYER_TENSORS.items()}


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
