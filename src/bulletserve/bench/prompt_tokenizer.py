"""The tokenizer prompts are measured with: a model folder or GGUF file, a dummy preset (whose
tokenizer is the default model's), the embedded default, or a Hugging Face name in the cache."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bulletserve.model.presets import PRESETS
from bulletserve.model.source import resolve_model
from bulletserve.model.tokenizer import load_tokenizer


def bench_tokenizer(name: str | None) -> PreTrainedTokenizerBase:
    """Load the tokenizer named by --tokenizer; ValueError (with the reason) if it cannot be."""
    if name is None or Path(name).expanduser().exists():
        return load_tokenizer(name)
    if name in PRESETS:
        return load_tokenizer(resolve_model(name, "dummy"))
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load tokenizer {name!r}: {exc}") from None
