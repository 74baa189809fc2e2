"""Tokenizers (through transformers) and incremental detokenization for streaming."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from bulletserve.model.gguf_reader import check_tokenizer_fields
from bulletserve.model.source import (
    ModelSource,
    building_cache,
    cache_dir_for,
    default_model_file,
    publish_cache_folder,
    resolve_model,
)

# Special tokens that end a chat turn in common templates; they stop generation like EOS.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_lock = threading.Lock()


def load_tokenizer(model: str | ModelSource | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model: its folder, its GGUF metadata, or (dummy weights without a
    folder's tokenizer) the default's; a folder holding only a tokenizer (`save_pretrained`'s
    files) works too.

    Converting a GGUF vocabulary takes seconds, so the result is cached on disk.
    """
    if isinstance(model, str) and (Path(model).expanduser() / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(Path(model).expanduser()))
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    folder = source.path if source.load_format in ("safetensors", "dummy") else None
    if folder is not None and (
        source.load_format == "safetensors" or (folder / "tokenizer_config.json").exists()
    ):
        return AutoTokenizer.from_pretrained(str(folder))
    gguf_file = source.path if source.load_format == "gguf" else default_model_file()
    return _gguf_tokenizer(gguf_file)


def _gguf_tokenizer(gguf_file: Path) -> PreTrainedTokenizerBase:
    cache = cache_dir_for(gguf_file, "tokenizer") / "tokenizer"
    with _lock, building_cache(cache, "tokenizer_config.json") as to_build:
        if not to_build:
            return AutoTokenizer.from_pretrained(str(cache))
        check_tokenizer_fields(gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        tokenizer.save_pretrained(str(tmp))
        publish_cache_folder(tmp, cache)
        return tokenizer


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, model_eos: tuple[int, ...]
) -> frozenset[int]:
    """Token ids that end generation: the model's EOS ids, the tokenizer's, and end-of-turn tokens
    that the chat template uses (GGUF metadata often names the wrong EOS)."""
    ids = set(model_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    for token in _END_OF_TURN_TOKENS:
        if token in vocab and token in template:
            ids.add(vocab[token])
    return frozenset(ids)


def _decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True
) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)`, straight to the Rust tokenizer where
    that is all transformers' fast `decode` does (no clean-up, no override): its Python wrapper
    cost about 4 of the 5 us a call, two calls a sampled token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = (
        backend is not None
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    if plain:
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without emitting broken UTF-8.

    Decodes a short window of recent tokens each step (not the whole sequence), and holds back
    text that ends in an incomplete character until the next token completes it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._ids: list[int] = list(prompt_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix, full = self._window()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        return self._advance(full[len(prefix) :])

    def flush(self) -> str:
        """The text held back so far, as the tokens decode (the request has finished): a
        genuine U+FFFD at the end, or an incomplete character cut off by the last token."""
        prefix, full = self._window()
        return self._advance(full[len(prefix) :]) if len(full) > len(prefix) else ""

    def _window(self) -> tuple[str, str]:
        """The window's text before the unread tokens, and with them."""
        decode = self._decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        return prefix, decode(self._ids[self._prefix_offset :])

    def _advance(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
