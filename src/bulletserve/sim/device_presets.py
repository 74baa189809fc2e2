"""The modeled device and model: hardware presets by short name, model shapes, KV capacity.

Device memory is not part of a hardware profile (the roofline does not need it), so the datasheet
sizes of the presets' devices are kept here: NVIDIA A100 Tensor Core GPU datasheet (A100 80GB
SXM: 80 GB HBM2e), NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 80 GB HBM3), NVIDIA H200
Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e), and NVIDIA H20 product brief (96 GB HBM3).
The "80 GB" parts hold 80 GiB (81,920 MiB, as `nvidia-smi` lists them), likewise 96 GiB for the
H20; the H200's 141 GB is decimal (143,771 MiB listed).
"""

from __future__ import annotations

import json
from pathlib import Path

from bulletserve.model.config import ModelConfig
from bulletserve.model.presets import PRESETS
from bulletserve.perf.hardware import PRESET_FILES, HardwareProfile, load_preset
from bulletserve.perf.model import DTYPE_BYTES

# `--hardware` short names -> perf preset names.
HARDWARE_ALIASES = {
    "a100-80g": "a100-80gb",
    "h100": "h100-sxm",
} | {name: name for name in PRESET_FILES}

GIB = 2**30
# Device memory in bytes, by hardware profile name (the presets' `name` fields).
DEVICE_MEMORY = {
    "A100-80GB-SXM": 80 * GIB,
    "H100-SXM": 80 * GIB,
    "H200-SXM": 141e9,
    "H20": 96 * GIB,
}
# Share of device memory the engine may use for weights and KV cache (vLLM's default
# --gpu-memory-utilization); the rest is left to activations and the CUDA context.
GPU_MEMORY_UTILIZATION = 0.9


class SimSetupError(ValueError):
    """A hardware, model or memory setting the simulator cannot use; the message says why."""


def load_hardware(spec: str) -> HardwareProfile:
    """A preset by short name (a100-80g, h100, h200, h20 or a perf preset name) or a JSON path."""
    if spec in HARDWARE_ALIASES:
        return load_preset(HARDWARE_ALIASES[spec])
    path = Path(spec)
    if not path.is_file():
        names = ", ".join(sorted(HARDWARE_ALIASES))
        raise SimSetupError(f"--hardware {spec!r}: not a preset ({names}) nor a profile file")
    try:
        return HardwareProfile.load(path)
    except ValueError as exc:
        raise SimSetupError(str(exc)) from None


def load_model_config(spec: str) -> ModelConfig:
    """A model preset by name, or a Hugging Face `config.json` (or a folder holding one)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SimSetupError(
            f"--model {spec!r}: not a preset ({', '.join(PRESETS)}) nor a config.json"
        )
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except (ValueError, KeyError) as exc:
        raise SimSetupError(f"--model {spec}: {exc}") from None


def weight_bytes(
    cfg: ModelConfig, dtype: str, tensor_parallel_size: int = 1, weight_bits: float | None = None
) -> float:
    """One rank's weights: its share of every layer and of the LM head, and the whole
    embedding (the engine's layout, `model.shard`), in `dtype` or `weight_bits` a weight."""
    embedding = cfg.vocab_size * cfg.hidden_size
    lm_head = 0 if cfg.tie_word_embeddings else embedding
    layers = cfg.num_parameters() - embedding - lm_head
    params = layers / tensor_parallel_size + embedding + lm_head / tensor_parallel_size
    per_weight = DTYPE_BYTES[dtype] if weight_bits is None else weight_bits / 8
    return float(params * per_weight)


def kv_cache_blocks(
    cfg: ModelConfig,
    dtype: str,
    block_size: int,
    device_memory: float,
    utilization: float = GPU_MEMORY_UTILIZATION,
    tensor_parallel_size: int = 1,
    weight_bits: float | None = None,
) -> int:
    """KV blocks that fit in utilization x each device's memory once its weights are loaded
    (under tensor parallelism a block holds each rank's share of the KV heads)."""
    weights = weight_bytes(cfg, dtype, tensor_parallel_size, weight_bits)
    kv_bytes = utilization * device_memory - weights
    try:
        rank_cfg = cfg.sharded(tensor_parallel_size)
    except ValueError as exc:
        raise SimSetupError(str(exc)) from None
    per_block = rank_cfg.kv_bytes_per_token(DTYPE_BYTES[dtype]) * block_size
    blocks = int(kv_bytes // per_block)
    if blocks < 1:
        raise SimSetupError(
            f"the weights ({weights / GIB:.1f} GiB a device) leave no KV cache in "
            f"{utilization:g} x {device_memory / GIB:.1f} GiB of device memory"
        )
    return blocks


def device_memory(hw: HardwareProfile, override: float | None) -> float:
    """Device memory in bytes: the override, else the datasheet size of a known preset."""
    if override is not None:
        return override
    if hw.name not in DEVICE_MEMORY:
        raise SimSetupError(
            f"hardware profile {hw.name!r} has no known memory size: pass --device-memory-gib "
            "or --num-gpu-blocks-override"
        )
    return DEVICE_MEMORY[hw.name]
