"""A model file is untrusted input: each crafted file below (the tiny Llama written as GGUF with
one field or tensor wrong, a compressed-tensors folder with a wrong scale, a safetensors folder
with a wrong shape) fails at load with one line naming the file, the key or tensor, and the
expected and found values, before any request could reach it; `bullet serve` prints that line
alone and exits non-zero."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bulletserve import LLM
from bulletserve.model.file_error import ModelFileError
from bulletserve.model.gguf_reader import GGUFError
from tests.tiny_models import TINY_VOCAB, write_llama_gguf

FIXTURES = Path(__file__).parent / "fixtures"
HIDDEN = 64  # the tiny Llama's width (tiny_llama_dir)


def _load(model: Path, tokenizer: Path | None, **kwargs: object) -> None:
    kwargs.setdefault("dtype", "float32")
    LLM(model=str(model), tokenizer=None if tokenizer is None else str(tokenizer),
        max_model_len=64, **kwargs)  # fmt: skip


def _nan_bytes(shape: tuple[int, int]) -> np.ndarray:
    """A matrix whose bytes were another format's, read as fp16: some decode to NaN or inf."""
    raw = np.random.default_rng(0).integers(0, 256, size=shape[0] * shape[1] * 2, dtype=np.uint8)
    return raw.view(np.float16).reshape(shape).astype(np.float32)


GGUF_CASES = {
    # name: (metadata overrides, tensor overrides, the message's parts)
    "embedding with fewer rows than the vocabulary": (
        {}, {"token_embd.weight": np.zeros((40000, HIDDEN))},
        ["token_embd.weight", f"shape [{TINY_VOCAB}, {HIDDEN}]", "found shape [40000, 64]"],
    ),
    "embedding with more rows than the vocabulary": (
        {}, {"token_embd.weight": np.zeros((60000, HIDDEN))},
        ["token_embd.weight", "found shape [60000, 64]"],
    ),
    "embedding narrower than the model": (
        {}, {"token_embd.weight": np.zeros((TINY_VOCAB, 48))},
        ["token_embd.weight", f"expected shape [{TINY_VOCAB}, 64]", "found shape [49152, 48]"],
    ),
    "vocab_size below the embedding's rows": (
        {"llama.vocab_size": 40000}, {},
        ["expected shape [40000, 64] (vocab_size 40000", "found shape [49152, 64]"],
    ),
    "no attention heads": (
        {"llama.attention.head_count": 0}, {},
        ["llama.attention.head_count: expected an integer in [1,", "found 0"],
    ),
    "no KV heads": (
        {"llama.attention.head_count_kv": 0}, {},
        ["llama.attention.head_count_kv: expected an integer in [1,", "found 0"],
    ),
    "KV heads not dividing the heads": (
        {"llama.attention.head_count_kv": 3}, {},
        ["llama.attention.head_count_kv: expected a divisor of num_attention_heads 4, found 3"],
    ),
    "heads not dividing the width": (
        {"llama.attention.head_count": 7}, {},
        ["llama.attention.head_count: expected a divisor of hidden_size 64, found 7"],
    ),
    "a width past any machine": (
        {"llama.embedding_length": 4_000_000_000}, {},
        ["llama.embedding_length: expected an integer in [1, 16777216], found 4000000000"],
    ),
    "BOS past the vocabulary": (
        {"tokenizer.ggml.bos_token_id": 60000}, {},
        ["tokenizer.ggml.bos_token_id: expected a token id in [0, 49152), found 60000"],
    ),
    "EOS past the vocabulary": (
        {"tokenizer.ggml.eos_token_id": 49152}, {},
        ["tokenizer.ggml.eos_token_id: expected a token id in [0, 49152), found 49152"],
    ),
    "NaN epsilon": (
        {"llama.attention.layer_norm_rms_epsilon": float("nan")}, {},
        ["llama.attention.layer_norm_rms_epsilon: expected a finite number > 0, found nan"],
    ),
    "q projection with too few columns": (
        {}, {"blk.0.attn_q.weight": np.zeros((HIDDEN, 32))},
        ["blk.0.attn_q.weight: expected shape [64, 64]", "found shape [64, 32]"],
    ),
    "a tensor of a layer the model lacks": (
        {}, {"blk.7.ffn_norm.weight": np.ones(HIDDEN)},
        ["blk.7.ffn_norm.weight: expected only the tensors of a llama model of 2 layers"],
    ),
    "a missing projection": (
        {}, {"blk.1.ffn_up.weight": None},
        ["blk.1.ffn_up.weight: expected a tensor of the file, found none"],
    ),
    "weights whose bytes are another format's": (
        {}, {"blk.1.ffn_down.weight": _nan_bytes((HIDDEN, 128))},
        ["layer 1's output: expected finite values for a short prompt", "NaN or infinite"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_a_crafted_gguf_file_fails_at_load_naming_what_is_wrong(case, tiny_llama_dir, tmp_path):
    metadata, tensors, parts = GGUF_CASES[case]
    path = write_llama_gguf(tiny_llama_dir, tmp_path / "crafted.gguf", {}, metadata, tensors)
    with pytest.raises(ModelFileError) as failure:
        _load(path, tiny_llama_dir)
    message = str(failure.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for part in parts:
        assert part in message


def test_a_packed_embedding_of_the_wrong_size_fails_at_load_too(tiny_llama_dir, tmp_path):
    """Served packed (--quantization gguf), the embedding and the tied LM head are its blocks:
    their shape is checked all the same (it once loaded and killed the engine at its first
    request)."""
    path = write_llama_gguf(
        tiny_llama_dir,
        tmp_path / "packed.gguf",
        {"token_embd": "Q8_0", "output": "Q8_0", "ffn_up": "Q8_0"},
        tensors={"token_embd.weight": np.zeros((40000, HIDDEN)), "output.weight": None},
    )
    with pytest.raises(ModelFileError, match=r"token_embd.weight: expected shape \[49152, 64\]"):
        _load(path, tiny_llama_dir, quantization="gguf")


# A tokenizer's metadata as llama.cpp writes it for a byte-level BPE vocabulary, in small.
TOKENIZER = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": ["a", "b", "ab", "<|endoftext|>"],
    "tokenizer.ggml.merges": ["a b"],
}


@pytest.mark.parametrize(
    ("dropped", "named"),
    [
        ("tokenizer.ggml.tokens", "lacks tokenizer.ggml.tokens"),
        ("tokenizer.ggml.merges", "lacks tokenizer.ggml.merges (or tokenizer.ggml.scores)"),
    ],
)
def test_a_gguf_tokenizer_without_its_vocabulary_or_merges_is_named(
    dropped, named, tiny_llama_dir, tmp_path
):
    """Named before transformers reads the file (which failed with `KeyError: 'tokens'`)."""
    path = write_llama_gguf(
        tiny_llama_dir, tmp_path / "no-tokens.gguf", {}, metadata={**TOKENIZER, dropped: None}
    )
    with pytest.raises(GGUFError, match=re.escape(named)):
        _load(path, None)


def _with_scale(folder: Path, scale: torch.Tensor, tmp_path: Path) -> Path:
    crafted = tmp_path / folder.name
    shutil.copytree(folder, crafted)
    weights = load_file(str(crafted / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight_scale"] = scale
    save_file(weights, str(crafted / "model.safetensors"))
    return crafted


@pytest.mark.parametrize(
    ("scale", "quantization"),
    [
        (torch.empty(0, dtype=torch.bfloat16), None),
        (torch.ones(7, 3, dtype=torch.bfloat16), None),
        (torch.ones(64, 3, dtype=torch.bfloat16), "none"),
    ],
    ids=["empty", "7x3", "64x3-dequantized"],
)
def test_a_compressed_checkpoint_with_a_wrong_scale_names_it(
    scale, quantization, tiny_llama_dir, tmp_path
):
    folder = _with_scale(FIXTURES / "w8a16-g32-tiny-llama", scale, tmp_path)
    with pytest.raises(ModelFileError) as failure:
        _load(folder, tiny_llama_dir, quantization=quantization)
    assert str(failure.value) == (
        f"{folder}: model.layers.0.mlp.down_proj.weight_scale: expected shape [64, G] with G "
        f"groups dividing the weight's 128 columns, found shape {list(scale.shape)}"
    )


def test_a_safetensors_folder_names_the_file_and_tensor_of_a_wrong_shape(tiny_llama_dir, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(tiny_llama_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.1.mlp.gate_proj.weight"] = torch.zeros(100, HIDDEN)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelFileError) as failure:
        _load(folder, None)
    assert str(failure.value).startswith(
        f"{folder / 'model.safetensors'}: model.layers.1.mlp.gate_proj.weight: expected shape "
        "[128, 64]"
    )


def test_a_config_with_a_pad_id_past_the_vocabulary_names_the_key(tiny_llama_dir, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": 10**6}))
    with pytest.raises(ModelFileError) as failure:
        _load(folder, None)
    assert str(failure.value) == (
        f"{folder / 'config.json'}: pad_token_id: expected a token id in [0, 49152), found 1000000"
    )


def test_bullet_serve_prints_the_one_line_and_exits_non_zero(tiny_llama_dir, tmp_path):
    """As a user sees it: the message alone, no traceback (one with --log-level debug). Slow
    (about 8 s): two `bullet serve` processes, each importing torch before it reads the file."""
    path = write_llama_gguf(
        tiny_llama_dir, tmp_path / "bad.gguf", {}, {"llama.attention.head_count": 0}
    )
    command = [
        sys.executable, "-c", "import sys; from bulletserve.cli import main; sys.exit(main())",
        "serve", "--model", str(path), "--tokenizer", str(tiny_llama_dir), "--port", "0",
    ]  # fmt: skip
    plain = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2
    assert "Traceback" not in plain.stderr
    assert plain.stderr.strip().splitlines()[-1] == (
        f"bullet serve: error: {path}: llama.attention.head_count: expected an integer in "
        "[1, 16777216], found 0"
    )
    debug = subprocess.run(
        [*command, "--log-level", "debug"], capture_output=True, text=True, timeout=120
    )
    assert debug.returncode == 2 and "Traceback" in debug.stderr
