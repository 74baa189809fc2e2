"""Build a DecoderLM and fill it from safetensors, GGUF or random (dummy) weights."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bulletserve.dist.parallel import TensorParallel
from bulletserve.model import compressed
from bulletserve.model.checks import check_fits, check_shapes
from bulletserve.model.config import ModelConfig
from bulletserve.model.cpu_kernels import fused_ops, packed_linear_kernel
from bulletserve.model.decoder import DecoderLM
from bulletserve.model.file_error import ModelFileError
from bulletserve.model.gguf_reader import checked_config, read_gguf
from bulletserve.model.presets import get_preset
from bulletserve.model.quantized import (
    PackedFormat,
    PackedPart,
    QuantizedLinearKernel,
    quantized_linear_kernel,
)
from bulletserve.model.shard import weight_split
from bulletserve.model.source import (
    ModelNotFoundError,
    ModelSource,
    building_cache,
    cache_dir_for,
    check_quantization,
    default_model_file,
    publish_cache_folder,
)

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX-512 bf16 or AMX). Without either (an
    AVX2-only x86 such as AMD Zen 3), PyTorch's bf16 GEMMs take a slow path: on 2 Zen 3 vCPUs
    the default model's 576 -> 1536 linear layer on 256 rows ran at 16 GFLOP/s in bf16 against
    106 in fp32, and its 100-token prefill took 1.57 s against 0.30 s
    (`git show 23ed970:scripts/cpu_dtype_speed.py`)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype` on `device`: auto means bf16 on a GPU that has it (else fp16) and on a CPU with
    native bf16, fp32 on any other CPU (see `cpu_has_native_bf16`)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(
            f"--dtype must be auto or one of {', '.join(DTYPES)}, not {name!r}"
        ) from None


def _is_embedded_default(source: ModelSource) -> bool:
    try:
        return source.load_format == "gguf" and source.path == default_model_file()
    except ModelNotFoundError:
        return False


def load_config(source: ModelSource) -> ModelConfig:
    """The model's config, its values checked (`checks.check_config`: ModelFileError naming
    the file and key)."""
    if source.load_format == "dummy" and source.preset is not None:
        return get_preset(source.preset)
    if source.load_format in ("safetensors", "dummy"):
        path = source.path / "config.json"
        try:
            return ModelConfig.from_json_file(path)
        except ModelFileError as exc:
            raise exc.in_file(path) from None
    return ModelConfig.from_json_file(_gguf_config(source.path))


def resolve_quantization(
    requested: str | None, source: ModelSource, device: torch.device, ranks: int = 1
) -> tuple[str, QuantizedLinearKernel | None]:
    """`--quantization` for this checkpoint and device, as vLLM's: detected from the checkpoint
    when omitted (a GGUF file: gguf; a folder whose config says compressed-tensors: that), with
    the kernel that runs it (None for none). An automatic choice where the packed kernel cannot
    run (a GPU, no C compiler, weights sharded over `ranks`) falls back to none with a warning;
    an explicit one is an error."""
    check_quantization(requested)
    method = (
        compressed.quantization_method(source.path) if source.load_format == "safetensors" else None
    )
    if method is not None and method != compressed.METHOD:
        raise ValueError(f"{source.path} is a {method} checkpoint, which bulletserve cannot serve")
    if method is not None:
        compressed.check_scheme(source.path)
    if requested == "none":
        return "none", None
    if requested is None and _is_embedded_default(source):
        # Measured (docs/benchmarks.md "Quantized models"): on two Zen 3 cores its Q4_1 blocks
        # decode one stream 1.64x faster than its fp32 dequantization but prefill slower, and
        # saturated at 0.60x the output; `--quantization gguf` serves it packed.
        return "none", None
    found = "gguf" if source.load_format == "gguf" else method
    if requested is None and found is None:
        return "none", None
    if requested is not None and requested != found:
        what = "a .gguf file" if requested == "gguf" else "a compressed-tensors checkpoint"
        raise ValueError(f"--quantization {requested} needs {what}; {source.name} is not one")
    chosen = requested or found
    kernel = quantized_linear_kernel(device) if ranks == 1 else None
    if kernel is not None:
        return chosen, kernel
    if ranks > 1:
        why = f"packed {chosen} weights are not sharded over tensor-parallel ranks yet"
    elif device.type != "cpu":
        why = f"packed {chosen} weights run on the CPU only (device {device.type})"
    else:
        why = "the packed weights' kernel is off (BULLET_CPU_KERNELS=0) or did not compile"
    if requested is not None:
        raise ValueError(
            f"--quantization {requested}: {why}; --quantization none dequantizes at load"
        )
    log.warning("%s: serving %s dequantized to the model's dtype", why, source.name)
    return "none", None


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    pack_linear: bool = True,
    tp: TensorParallel | None = None,
    quantization: str | None = None,
) -> DecoderLM:
    """A model ready to run, with weights of `dtype` on `device` (a quantized checkpoint's kept
    packed where `quantization`, as `resolve_quantization` reads it, says so). `pack_linear=False`
    keeps PyTorch's GEMM for the float projections even where our packed kernel would be faster.
    `tp`: this rank's shard of the weights only (read in slices from safetensors; the same values
    as the whole model's)."""
    config = load_config(source)
    ranks = 1 if tp is None else tp.size
    quantization, quantized_kernel = resolve_quantization(quantization, source, device, ranks)
    try:
        # The whole model is laid out at `dtype` first (packed weights replace their part).
        check_fits(config.sharded(ranks), dtype.itemsize, device_memory(device), device.type)
    except ModelFileError as exc:
        raise exc.in_file(source.path) from None
    with torch.device("meta"):
        model = DecoderLM(config, max_positions, tp)
    model = model.to_empty(device=device).to(dtype)
    model.reset_rotary(device, max_positions)
    is_compressed = source.load_format == "safetensors" and (
        compressed.quantization_method(source.path) == compressed.METHOD
    )
    # Every tensor's shape is checked against the config before it is copied in: a GGUF file's
    # as it is read (gguf_reader), a folder's from its headers, a compressed one's as unpacked.
    if source.load_format == "dummy":
        _fill_random(model, seed)
    elif quantized_kernel is not None:
        if is_compressed:
            packed, floats = compressed.read_compressed(source.path, packed=True)
            _check_read(config, packed, floats, source.path)
        else:
            packed, floats = _packed_gguf(source.path)
        unpacked = model.use_quantized_weights(packed, quantized_kernel)
        model.load_hf_weights(list(floats.items()) + unpacked)
    elif is_compressed:
        if tp is not None and tp.size > 1:
            raise ValueError("a compressed-tensors checkpoint is not sharded over ranks yet")
        _, dequantized = compressed.read_compressed(source.path, packed=False)
        _check_read(config, {}, dequantized, source.path)
        model.load_hf_weights(list(dequantized.items()))
    elif source.load_format == "safetensors":
        _check_folder(config, source.path)
        model.load_hf_weights(_safetensors_weights(source.path, model))
    else:
        model.load_hf_weights(_safetensors_weights(dequantized_folder(source.path), model))
    model.use_fused_ops(fused_ops(dtype, device))
    with torch.inference_mode():
        float_weights = model.layer_projection_weights()
        linear = (
            packed_linear_kernel(dtype, device, float_weights)
            if pack_linear and float_weights
            else None
        )
        if linear is not None:
            model.use_packed_linear(linear)
    log.info("weights (--quantization %s): %s", quantization, model.weight_formats())
    if device.type == "cuda":
        # The lanes run on streams of their own, which do not wait for the default stream.
        torch.cuda.synchronize(device)
    return model.eval()


def device_memory(device: torch.device) -> int:
    """The device's whole memory in bytes (a GPU's, or this machine's for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_folder(config: ModelConfig, folder: Path) -> None:
    """Each tensor's shape in a safetensors folder (from the files' headers) against the config;
    ModelFileError naming the file that holds a wrong one."""
    shapes: dict[str, tuple[int, ...]] = {}
    files: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
                files[name] = file
    try:
        check_shapes(config, shapes)
    except ModelFileError as exc:
        raise exc.in_file(files.get(exc.what, folder)) from None


def _check_read(
    config: ModelConfig, packed: dict[str, PackedPart], floats: dict[str, torch.Tensor], path: Path
) -> None:
    """The shapes of a checkpoint's tensors as read (packed matrices by their rows and columns)."""
    shapes = {name: (part.rows, part.in_features) for name, part in packed.items()}
    shapes |= {name: tuple(tensor.shape) for name, tensor in floats.items()}
    try:
        check_shapes(config, shapes)
    except ModelFileError as exc:
        raise exc.in_file(path) from None


def _safetensors_weights(folder: Path, model: DecoderLM) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors, each only in the part `model`'s rank holds."""
    shard = model.tp.shard
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                split = weight_split(name, model.config) if shard.size > 1 else None
                if split is None:
                    yield name, f.get_tensor(name)
                    continue
                lazy = f.get_slice(name)
                parts = [
                    lazy[start:end] if split.dim == 0 else lazy[:, start:end]
                    for start, end in split.ranges(shard)
                ]
                yield name, parts[0] if len(parts) == 1 else torch.cat(parts, split.dim)


@torch.inference_mode()
def _fill_random(model: DecoderLM, seed: int) -> None:
    """Random weights drawn where they live, by that device's generator: an 8B model's draw
    stays on the GPU instead of 8 billion CPU samples and a copy (so the values differ
    between devices)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    shard = model.tp.shard
    with torch.device("meta"):
        whole = dict(DecoderLM(model.config, 1).named_parameters())
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            # A rank draws the whole weight (the same values as one rank's) and keeps its part.
            split = weight_split(name, model.config) if shard.size > 1 else None
            full = (
                param
                if split is None
                else torch.empty(whole[name].shape, dtype=param.dtype, device=device)
            )
            # Filled a row block at a time so an 8B model never needs a second fp32 copy.
            for rows in torch.split(torch.arange(full.shape[0]), 4096):
                block = torch.randn(len(rows), *full.shape[1:], generator=generator, device=device)
                full[rows[0] : rows[-1] + 1].copy_(block * 0.02)
            if split is not None:
                param.copy_(split.take(full, shard))


def _gguf_config(gguf_file: Path) -> Path:
    """A GGUF file's Hugging Face config.json, cached: the gguf package's reader takes seconds
    to parse a file's metadata (its vocabulary's arrays)."""
    folder = cache_dir_for(gguf_file, "config") / "config"
    with building_cache(folder, "config.json") as to_build:
        if to_build:
            config, _ = checked_config(gguf_file)  # its values and shapes, before any write
            tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            publish_cache_folder(tmp, folder)
    return folder / "config.json"


_PACKED_FORMATS = "packed_formats"  # safetensors metadata: {name: [format id, in_features]}


def _packed_gguf(gguf_file: Path) -> tuple[dict[str, PackedPart], dict[str, torch.Tensor]]:
    """(the packed matrices, the float tensors) of a GGUF file by Hugging Face name, read once
    into a cached safetensors file (the packed ones as their bytes) and memory-mapped from it
    after: reading the GGUF file takes seconds."""
    folder = cache_dir_for(gguf_file, "packed") / "packed"
    with building_cache(folder, "model.safetensors") as to_build:
        if to_build:
            _, tensors = read_gguf(gguf_file, packed=True)
            formats = {
                name: [int(t.format), t.in_features]
                for name, t in tensors.items()
                if isinstance(t, PackedPart)
            }
            plain = {n: t.data if isinstance(t, PackedPart) else t for n, t in tensors.items()}
            tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            metadata = {_PACKED_FORMATS: json.dumps(formats)}
            save_file(plain, str(tmp / "model.safetensors"), metadata)
            publish_cache_folder(tmp, folder)
    packed: dict[str, PackedPart] = {}
    floats: dict[str, torch.Tensor] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        formats = json.loads(f.metadata()[_PACKED_FORMATS])
        for name in f.keys():
            if name in formats:
                format_id, in_features = formats[name]
                packed[name] = PackedPart(PackedFormat(format_id), f.get_tensor(name), in_features)
            else:
                floats[name] = f.get_tensor(name)
    return packed, floats


def dequantized_folder(gguf_file: Path) -> Path:
    """Dequantize a GGUF file once into a cached HF folder (config.json + fp32 weights, as
    transformers loads them)."""
    folder = cache_dir_for(gguf_file, "weights") / "weights"
    with building_cache(folder, "model.safetensors") as to_build:
        if to_build:
            hf_config, tensors = read_gguf(gguf_file)  # checked as it is read
            tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
            save_file(tensors, str(tmp / "model.safetensors"))
            publish_cache_folder(tmp, folder)
    return folder
