"""Checkpoints in compressed-tensors' format (what llmcompressor writes and vLLM serves), read
with the `compressed-tensors` package (its description of the scheme, its unpacking of int4/int8
values from int32 words).

Served packed: symmetric int8 or int4 weights with a scale per output channel or per group of a
multiple of 32 inputs (llmcompressor's W8A8, W8A16 and W4A16 schemes). The integer values are
kept as they are and become GGUF blocks of the same values, each 32-weight block carrying its
channel's or group's scale as fp16 (exact for a bf16 or fp16 scale in fp16's normal range,
which a load checks): int8 as Q8_0 (one byte and a sixteenth a weight), int4 as Q4_0 (its
values plus 8, as Q4_0 stores them; 4.5 bits a weight), so the packed kernel runs them as it
runs a GGUF file's. Its activations are quantized per 32 values: finer than W8A8's per-token
scale (what vLLM's int8 GEMM uses), so our products lie nearer the unquantized activations';
where the scheme leaves activations in 16 bits (W8A16, W4A16), the AVX2 kernel still rounds
them to int8 per 32 values, as llama.cpp does for its own formats. Any other scheme in the file
(groups not a multiple of 32, asymmetric, float8, static activation scales) is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from bulletserve.model.file_error import ModelFileError
from bulletserve.model.quantized import PackedFormat, PackedPart

METHOD = "compressed-tensors"
_BLOCK = PackedFormat.Q8_0.block_weights
# Tensors read beside a matrix's values, not weights of their own.
_BESIDE = (".weight_scale", ".weight_zero_point", ".weight_shape", ".input_scale")


def quantization_method(folder: Path) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, if it has one."""
    config = json.loads((folder / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def check_scheme(folder: Path) -> int:
    """The bits of the checkpoint's weights (8 or 4); ValueError naming what its scheme asks
    that we do not serve."""
    from compressed_tensors.quantization import QuantizationConfig

    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    if config.kv_cache_scheme is not None:
        raise ValueError(f"{folder}: a quantized KV cache (kv_cache_scheme) is not supported yet")
    bits = set()
    for name, group in config.config_groups.items():
        weights, inputs = group.weights, group.input_activations
        problems = []
        if weights is None:
            problems.append("no weight scheme")
        else:
            bits.add(weights.num_bits)
            if weights.type != "int" or weights.num_bits not in (4, 8):
                problems.append(f"{weights.num_bits}-bit {weights.type} weights")
            if weights.strategy == "group" and (weights.group_size or 0) % _BLOCK:
                problems.append(f"weight groups of {weights.group_size}, not a multiple of 32")
            elif weights.strategy not in ("channel", "group"):
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
                "bulletserve serves symmetric int8 and int4 weights with a scale per output "
                "channel or per group of a multiple of 32 (W8A8, W8A16, W4A16) only yet"
            )
    if len(bits) != 1:
        raise ValueError(f"{folder}: weights of {sorted(bits)} bits in one checkpoint")
    return bits.pop()


def _as_blocks(values: torch.Tensor, scale: torch.Tensor, name: str, bits: int) -> PackedPart:
    """Signed `bits`-bit values (int8 [out, in]) and their scales ([out, 1] per channel,
    [out, groups] per group) as Q8_0 or, for 4 bits, Q4_0 blocks of the same values."""
    out, width = values.shape
    blocks = width // _BLOCK
    scale = scale.reshape(out, -1).float()
    if width % _BLOCK or blocks % scale.shape[1]:
        raise ValueError(
            f"{name}: {width} columns in {scale.shape[1]} groups do not split into "
            f"{_BLOCK}-weight blocks"
        )
    half = scale.to(torch.float16)
    tiny = scale.abs() < torch.finfo(torch.float16).tiny
    if bool((tiny & (scale != 0)).any()) or not bool(torch.isfinite(half).all()):
        raise ValueError(
            f"{name}: a scale is outside fp16's normal range, which the packed blocks hold; "
            "--quantization none serves the checkpoint dequantized"
        )
    per_block = half.repeat_interleave(blocks // scale.shape[1], dim=1)
    scales = per_block.contiguous().view(torch.uint8).view(out, blocks, 2)
    if bits == 4:
        # Q4_0: byte j of a block holds value j plus 8 in its low nibble, value j + 16 in its high.
        unsigned = (values.view(out, blocks, 2, 16).to(torch.int16) + 8).to(torch.uint8)
        nibbles = unsigned[:, :, 0] | (unsigned[:, :, 1] << 4)
        data = torch.cat([scales, nibbles], dim=2).reshape(out, -1).contiguous()
        return PackedPart(PackedFormat.Q4_0, data, width)
    data = torch.cat([scales, values.view(torch.uint8).view(out, blocks, _BLOCK)], dim=2)
    return PackedPart(PackedFormat.Q8_0, data.reshape(out, -1).contiguous(), width)


def _weight_shape(
    stored: torch.Tensor | None, stem: str, words: torch.Tensor, bits: int
) -> torch.Size:
    """A pack-quantized matrix's [rows, columns] (its `weight_shape` tensor), checked against
    the int32 words that hold its values."""
    name = stem + ".weight_shape"
    if stored is None or stored.numel() != 2:
        found = "none" if stored is None else f"shape {list(stored.shape)}"
        raise ModelFileError(name, "two integers [rows, columns]", found)
    rows, columns = (int(v) for v in stored.tolist())
    per_word = 32 // bits
    if words.ndim != 2 or (rows, -(-columns // per_word)) != tuple(words.shape):
        raise ModelFileError(
            name,
            f"the shape of {stem}.weight_packed's {list(words.shape)} int32 words "
            f"({per_word} values a word)",
            [rows, columns],
        )
    return torch.Size((rows, columns))


def _check_scale(scale: torch.Tensor, name: str, shape: torch.Size) -> None:
    """A matrix's scales: [rows] or [rows, 1] per channel, [rows, groups] with the groups
    dividing its columns per group."""
    rows, columns = shape
    groups = scale.shape[1] if scale.ndim == 2 else 1
    if scale.ndim not in (1, 2) or scale.shape[0] != rows or groups < 1 or columns % groups:
        raise ModelFileError(
            name,
            f"shape [{rows}, G] with G groups dividing the weight's {columns} columns",
            f"shape {list(scale.shape)}",
        )


def _tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_compressed(
    folder: Path, packed: bool
) -> tuple[dict[str, PackedPart], dict[str, torch.Tensor]]:
    """(the integer matrices as Q8_0 or Q4_0 parts, the float tensors) by Hugging Face name;
    with `packed` False every matrix dequantized to fp32 instead (`--quantization none`).
    ModelFileError naming the folder and tensor where a scale or shape is wrong."""
    try:
        return _read(folder, packed)
    except ModelFileError as exc:
        raise exc.in_file(folder) from None


def _read(folder: Path, packed: bool) -> tuple[dict[str, PackedPart], dict[str, torch.Tensor]]:
    from compressed_tensors.compressors import unpack_from_int32

    bits = check_scheme(folder)
    tensors = dict(_tensors(folder))
    parts: dict[str, PackedPart] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(_BESIDE):
            continue
        stem = name.removesuffix(".weight_packed").removesuffix(".weight")
        scale = tensors.get(stem + ".weight_scale")
        if scale is None:
            floats[name] = tensor
            continue
        if name.endswith(".weight_packed"):  # pack-quantized: values in int32 words
            shape = _weight_shape(tensors.get(stem + ".weight_shape"), stem, tensor, bits)
            values = unpack_from_int32(tensor, bits, shape)
        elif tensor.dtype == torch.int8 and bits == 8:
            values = tensor
        else:
            raise ValueError(
                f"{name}: {tensor.dtype} values beside a scale, for {bits}-bit weights"
            )
        _check_scale(scale, stem + ".weight_scale", values.shape)
        weight_name = stem + ".weight"
        if packed:
            parts[weight_name] = _as_blocks(values, scale, name, bits)
        else:
            groups = scale.float().reshape(values.shape[0], -1)
            per_weight = groups.repeat_interleave(values.shape[1] // groups.shape[1], dim=1)
            floats[weight_name] = values.float() * per_weight
    return parts, floats
