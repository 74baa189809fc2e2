"""The shape of a decoder model, independent of where its weights come from. (Each layer
keeps its settings in a `config.py`: the scheduler's in sched/config.py, the engine's in
engine/config.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bulletserve.model.file_error import (
    MAX_LAYERS,
    ModelFileError,
    check_int,
    check_positive_finite,
    is_token_id,
    shown,
)

# Hugging Face `architectures` entries we implement, mapped to our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its settings is not implemented."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `default`, `linear` or Llama 3.1's `llama3`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code and the performance model need to know about a decoder."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def check(self, pad_token_id: object = None) -> None:
        """ModelFileError (naming the Hugging Face key) unless the values are in range and
        consistent with each other (model/checks.py)."""
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for key in sizes:
            check_int(sizes, key, 1)
        check_int({"num_hidden_layers": self.num_layers}, "num_hidden_layers", 1, MAX_LAYERS)
        if self.hidden_size % self.num_heads:
            expected = f"a divisor of hidden_size {self.hidden_size}"
            raise ModelFileError("num_attention_heads", expected, self.num_heads)
        if self.num_heads % self.num_kv_heads:
            expected = f"a divisor of num_attention_heads {self.num_heads}"
            raise ModelFileError("num_key_value_heads", expected, self.num_kv_heads)
        if self.head_dim % 2:
            raise ModelFileError("head_dim", "an even number (RoPE rotates pairs)", self.head_dim)
        check_positive_finite("rms_norm_eps", self.rms_norm_eps)
        check_positive_finite("rope_theta", self.rope_theta)
        scaling = self.rope_scaling
        if scaling.rope_type != "default":
            for key in ("factor", "low_freq_factor", "high_freq_factor"):
                check_positive_finite(f"rope_scaling.{key}", getattr(scaling, key))
            key = "rope_scaling.original_max_position_embeddings"
            check_int({key: scaling.original_max_position_embeddings}, key, 1)
        vocabulary = f"a token id in [0, {self.vocab_size})"
        ids = [("bos_token_id", self.bos_token_id), ("pad_token_id", pad_token_id)]
        ids += [("eos_token_id", eos) for eos in self.eos_token_ids]
        for key, value in ids:
            if value is not None and not is_token_id(value, self.vocab_size):
                raise ModelFileError(key, vocabulary, shown(value))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def sharded(self, size: int) -> ModelConfig:
        """One of `size` tensor-parallel ranks' share of the layers: its query heads, KV heads
        and MLP columns (the vocabulary and hidden size stay whole). Raises where `size` does
        not divide them."""
        if size == 1:
            return self
        for name, count in (
            ("attention heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            ("MLP columns (intermediate_size)", self.intermediate_size),
        ):
            if count % size:
                raise ValueError(
                    f"--tensor-parallel-size {size} does not divide the model's {count} {name}"
                )
        return replace(
            self,
            num_heads=self.num_heads // size,
            num_kv_heads=self.num_kv_heads // size,
            intermediate_size=self.intermediate_size // size,
        )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary."""
        archs = cfg.get("architectures") or []
        family = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if family is None:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {supported}"
            )
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
            raise UnsupportedModelError(
                f"unsupported MLP: hidden_act={cfg.get('hidden_act')!r}, "
                f"mlp_bias={cfg.get('mlp_bias')}"
            )
        num_heads = check_int(cfg, "num_attention_heads", 1)
        hidden = check_int(cfg, "hidden_size", 1)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        config = cls(
            family=family,
            vocab_size=check_int(cfg, "vocab_size", 1),
            hidden_size=hidden,
            intermediate_size=check_int(cfg, "intermediate_size", 1),
            num_layers=check_int(cfg, "num_hidden_layers", 1, MAX_LAYERS),
            num_heads=num_heads,
            num_kv_heads=_int_or(cfg, "num_key_value_heads", num_heads),
            head_dim=_int_or(cfg, "head_dim", hidden // num_heads),
            max_position_embeddings=_int_or(cfg, "max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        config.check(cfg.get("pad_token_id"))
        return config

    @classmethod
    def from_json_file(cls, path: Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))


def _int_or(cfg: dict[str, Any], key: str, default: int) -> int:
    """`cfg[key]`, checked, where it is set (None: Hugging Face's "derive it")."""
    return check_int(cfg, key, 1) if cfg.get(key) is not None else default


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling:
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    if rope_type not in ("linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
