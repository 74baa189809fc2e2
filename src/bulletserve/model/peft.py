"""A LoRA adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`) read and
laid onto our fused projections: q, k and v onto `qkv_proj`, gate and up onto `gate_up_proj`, o and
down as they are. What we do not serve is refused at load, naming the field: DoRA, trained
biases, `modules_to_save`, a rank above `--max-lora-rank`, a module the base lacks or whose
shape differs, GPT-2's `fan_in_fan_out` layout, a `.bin` file.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from bulletserve.model.config import ModelConfig
from bulletserve.model.lora import AdapterWeights, LoRAProjection

# PEFT's module name -> (our fused projection, the part of its output it writes).
PARTS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_WEIGHT = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter we cannot serve; the message names the field or file and why."""


def read_adapter(
    path: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype
) -> AdapterWeights:
    """The adapter in folder `path` for a base of `config`, its weights in `dtype`;
    AdapterError naming what we cannot serve."""
    folder = Path(path).expanduser()
    settings = _read_settings(folder)
    rank = settings["r"]
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder}: adapter_config.json r must be a positive integer")
    if rank > max_rank:
        raise AdapterError(
            f"{folder}: adapter_config.json r is {rank}, above --max-lora-rank {max_rank}"
        )
    alpha = settings.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    pattern = settings.get("rank_pattern") or {}
    alpha_pattern = settings.get("alpha_pattern") or {}
    if pattern or alpha_pattern:
        raise AdapterError(
            f"{folder}: adapter_config.json rank_pattern / alpha_pattern: not served"
        )
    tensors = _read_tensors(folder)
    sizes = {
        "qkv": (config.q_size, config.kv_size, config.kv_size),
        "o": (config.hidden_size,),
        "gate_up": (config.intermediate_size, config.intermediate_size),
        "down": (config.hidden_size,),
    }
    inputs = {
        "qkv": config.hidden_size,
        "o": config.q_size,
        "gate_up": config.hidden_size,
        "down": config.intermediate_size,
    }
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _WEIGHT.match(name)
        if match is None:
            raise AdapterError(f"{folder}: weight {name!r} is not a LoRA A or B of a decoder layer")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in PARTS:
            raise AdapterError(f"{folder}: module {module!r} ({name}): the base has no such one")
        if layer >= config.num_layers:
            raise AdapterError(
                f"{folder}: {name} is for layer {layer}; the base has {config.num_layers}"
            )
        found.setdefault((layer, module), {})[which] = tensor
    layers: list[dict[str, LoRAProjection]] = [{} for _ in range(config.num_layers)]
    for layer in range(config.num_layers):
        for projection, parts in sizes.items():
            modules = [m for m, (p, _) in PARTS.items() if p == projection]
            present = [(m, found.get((layer, m))) for m in modules]
            if not any(weights for _, weights in present):
                continue
            a_rows, b_blocks = [], []
            for part, (module, weights) in enumerate(present):
                if not weights:
                    continue
                name = f"layer {layer} {module}"
                if set(weights) != {"A", "B"}:
                    raise AdapterError(f"{folder}: {name} has lora_A or lora_B alone")
                a, b = weights["A"], weights["B"]
                if a.shape != (rank, inputs[projection]) or b.shape != (parts[part], rank):
                    raise AdapterError(
                        f"{folder}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                        f"do not fit the base's [{parts[part]}, {inputs[projection]}] projection "
                        f"at rank {rank}"
                    )
                a_rows.append(a)
                b_blocks.append((part, b * scale))
            a = torch.cat(a_rows).to(dtype)
            b = torch.zeros(sum(parts), a.shape[0], dtype=dtype)
            for column, (part, block) in enumerate(b_blocks):
                top = sum(parts[:part])
                b[top : top + parts[part], column * rank : (column + 1) * rank] = block
            layers[layer][projection] = LoRAProjection(a.contiguous(), b.contiguous())
    if not any(layers):
        raise AdapterError(f"{folder}: adapter_model.safetensors holds no LoRA weight")
    return AdapterWeights(rank, tuple(layers))


def _read_settings(folder: Path) -> dict:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (a PEFT LoRA adapter's folder)")
    try:
        settings = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{config_file}: not JSON: {exc}") from None
    kind = settings.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{config_file}: peft_type {kind!r}: only LORA adapters are served")
    if settings.get("use_dora"):
        raise AdapterError(f"{config_file}: use_dora: DoRA adapters are not served")
    if settings.get("modules_to_save"):
        raise AdapterError(
            f"{config_file}: modules_to_save {settings['modules_to_save']}: whole trained "
            "modules beside the LoRA weights are not served"
        )
    if settings.get("bias", "none") != "none":
        raise AdapterError(
            f"{config_file}: bias {settings['bias']!r}: trained biases are not served"
        )
    if settings.get("fan_in_fan_out"):
        raise AdapterError(
            f"{config_file}: fan_in_fan_out: GPT-2's transposed layout; the bases served here "
            "keep [out, in] weights"
        )
    if "r" not in settings:
        raise AdapterError(f"{config_file}: no r (the adapter's rank)")
    return settings


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(
                f"{folder}: adapter_model.bin: pickled weights are not loaded (they can run "
                "code); save the adapter with safetensors (PEFT's default)"
            )
        raise AdapterError(f"{folder}: no adapter_model.safetensors")
    with safe_open(str(weights), framework="pt") as handle:
        return {name: handle.get_tensor(name).float() for name in handle.keys()}  # noqa: SIM118
