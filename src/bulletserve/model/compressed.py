"""Checkpoints in compressed-tensors' format (what llmcompressor writes and vLLM serves), read
with the `compressed-tensors` package's own description of the scheme.

Served packed: int8 weights with one scale per output channel (llmcompressor's W8A8 and W8A16
schemes). Each row's int8 values are kept as they are and become GGUF Q8_0 blocks, the row's
scale repeated in each 32-weight block as fp16 (exact for a bf16 or fp16 scale in fp16's normal
range, which a load checks), so the packed kernel runs them as it runs a GGUF file's Q8_0: one
byte and a sixteenth a weight. Its activations are quantized per 32 values, finer than W8A8's
per-token scale (what vLLM's int8 GEMM uses), so our products lie nearer the unquantized
activations'. Any other scheme in the file (4-bit, grouped, asymmetric, float8, static
activation scales) is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from bulletserve.model.quantized import PackedFormat, PackedPart

METHOD = "compressed-tensors"
_BLOCK = PackedFormat.Q8_0.block_weights


def quantization_method(folder: Path) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, if it has one."""
    config = json.loads((folder / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def check_scheme(folder: Path) -> None:
    """ValueError naming what the checkpoint's scheme asks that we do not serve."""
    from compressed_tensors.quantization import QuantizationConfig

    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    if config.kv_cache_scheme is not None:
        raise ValueError(f"{folder}: a quantized KV cache (kv_cache_scheme) is not supported yet")
    for name, group in config.config_groups.items():
        weights, inputs = group.weights, group.input_activations
        problems = []
        if weights is None:
            problems.append("no weight scheme")
        else:
            if (weights.type, weights.num_bits) != ("int", 8):
                problems.append(f"{weights.num_bits}-bit {weights.type} weights")
            if weights.strategy != "channel":
                problems.append(f"weights quantized per {weights.strategy}")
            if not weights.symmetric:
                problems.append("asymmetric weights")
        if inputs is not None and not (
            inputs.dynamic and inputs.type == "int" and inputs.num_bits == 8
        ):
            problems.append("static or non-int8 activation scales")
        if group.output_activations is not None:
            problems.append("quantized outputs")
        if problems:
            raise ValueError(
                f"{folder}: compressed-tensors group {name} has {', '.join(problems)}; "
                "bulletserve serves int8 weights with a scale per output channel (W8A8, W8A16) "
                "only yet"
            )


def _int8_rows_as_q8_0(weight: torch.Tensor, scale: torch.Tensor, name: str) -> PackedPart:
    """int8 [out, in] and its per-row scale as Q8_0 blocks of the same values."""
    out, width = weight.shape
    if width % _BLOCK:
        raise ValueError(f"{name}: {width} columns, not a whole number of {_BLOCK}-weight blocks")
    scale = scale.reshape(out).float()
    half = scale.to(torch.float16)
    tiny = scale.abs() < torch.finfo(torch.float16).tiny
    if bool((tiny & (scale != 0)).any()) or not bool(torch.isfinite(half).all()):
        raise ValueError(f"{name}: a channel's scale is outside fp16's normal range")
    blocks = width // _BLOCK
    scales = half.view(torch.uint8).view(out, 1, 2).expand(out, blocks, 2)
    values = weight.view(torch.uint8).view(out, blocks, _BLOCK)
    data = torch.cat([scales, values], dim=2).reshape(out, -1).contiguous()
    return PackedPart(PackedFormat.Q8_0, data, width)


def _tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_compressed(
    folder: Path, packed: bool
) -> tuple[dict[str, PackedPart], dict[str, torch.Tensor]]:
    """(the int8 matrices as Q8_0 parts, the float tensors) by Hugging Face name; with `packed`
    False every matrix dequantized to fp32 instead (`--quantization none`)."""
    check_scheme(folder)
    tensors = dict(_tensors(folder))
    parts: dict[str, PackedPart] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".weight_zero_point", ".input_scale")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        if scale is None:
            floats[name] = tensor
        elif tensor.dtype != torch.int8:
            raise ValueError(f"{name}: expected int8 values beside its scale, got {tensor.dtype}")
        elif packed:
            parts[name] = _int8_rows_as_q8_0(tensor, scale, name)
        else:
            floats[name] = tensor.float() * scale.float().reshape(-1, 1)
    return parts, floats
