"""GGUF weights served packed: our kernel against the gguf package's own dequantization (llama.cpp's
Python reference), and a packed model against the same file dequantized at load."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bulletserve import LLM, SamplingParams
from bulletserve.engine.model_runner import ModelRunner, SeqWork
from bulletserve.kv.pool import KVPool
from bulletserve.model.decoder import DecoderLM, Linear, LogitsBuffer
from bulletserve.model.loader import load_model
from bulletserve.model.quantized import (
    PackedFormat,
    PackedPart,
    QuantizedLinearKernel,
    QuantizedWeight,
    quantized_linear_kernel,
)
from bulletserve.model.source import resolve_model
from tests.tiny_models import random_prompts, write_llama_gguf

# A fused q/k/v of three formats and a gate/up of one, as llama.cpp's mixes (Q4_K_M) do.
MIXED_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
    "output": "Q4_1",
}


@pytest.fixture(scope="module")
def kernel() -> QuantizedLinearKernel:
    found = quantized_linear_kernel(torch.device("cpu"))
    if found is None:
        pytest.skip("our CPU kernels do not build here")
    return found


def random_blocks(fmt: PackedFormat, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every block (each bit pattern is a valid block) with fp16 scales set to
    sizes real files hold, so that sums stay finite."""
    rng = np.random.default_rng(seed)
    blocks = width // fmt.block_weights
    data = rng.integers(0, 256, size=(rows, blocks, fmt.block_bytes), dtype=np.uint8)
    scale_offsets = {PackedFormat.Q6_K: (208,), PackedFormat.Q4_0: (0,), PackedFormat.Q8_0: (0,)}
    for offset in scale_offsets.get(fmt, (0, 2)):
        scales = rng.uniform(0.001, 0.02, size=(rows, blocks)).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, -1)


def reference_weight(data: np.ndarray, fmt: PackedFormat) -> torch.Tensor:
    array = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(fmt)))
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


def int8_groups(x: torch.Tensor, fmt: PackedFormat) -> torch.Tensor:
    """x with each row's groups of a block's width (32 or 256) rounded to int8 steps of
    max|x| / 127 (llama.cpp's Q8_0 or Q8_K activations, what the AVX2 path multiplies)."""
    groups = x.view(x.shape[0], -1, fmt.block_weights)
    step = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups / torch.where(step > 0, step, 1)) * step).view_as(x)


@pytest.mark.parametrize("fmt", list(PackedFormat), ids=lambda f: f.name)
def test_each_format_unpacks_as_the_gguf_package_does(kernel, fmt):
    data = random_blocks(fmt, 24, 1280)
    part = PackedPart(fmt, torch.from_numpy(data), 1280)
    assert torch.equal(kernel.dequantize(part), reference_weight(data, fmt))
    ids = torch.tensor([23, 0, 7, 7])
    assert torch.equal(kernel.dequantize(part, ids), reference_weight(data, fmt)[ids])


@pytest.mark.parametrize("fmt", list(PackedFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9, 40])
def test_packed_linear_is_dequantize_then_matmul(kernel, fmt, rows):
    """Both paths (int8 activations where compiled, and fp32), over rows that leave every
    remainder of the kernel's four-row groups, across the 1,024-weight chunks of the portable
    path (a width of 2,304)."""
    width = 2304
    data = random_blocks(fmt, 40, width, seed=rows)
    weight = QuantizedWeight((PackedPart(fmt, torch.from_numpy(data), width),))
    reference = reference_weight(data, fmt)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    expected = x @ reference.T
    scale = float(expected.abs().max())
    exact = dataclasses.replace(kernel, int8_activations=False)
    assert float((exact(x, weight) - expected).abs().max()) < 1e-5 * scale
    if kernel.int8_activations:
        ours = kernel(x, weight)
        assert float((ours - int8_groups(x, fmt) @ reference.T).abs().max()) < 1e-5 * scale
        assert float((ours - expected).abs().max()) < 3e-2 * scale


def test_a_weight_of_several_formats_with_bias(kernel):
    """Parts of different formats one above the other, as a fused q/k/v of Q4_K, Q4_K and Q6_K,
    each part's columns of the output where they belong; bf16 in and out."""
    width = 512
    formats = [PackedFormat.Q4_K, PackedFormat.Q4_K, PackedFormat.Q6_K]
    datas = [random_blocks(f, 16 * (i + 1), width, seed=i) for i, f in enumerate(formats)]
    pairs = list(zip(formats, datas, strict=True))
    weight = QuantizedWeight.stack(
        [QuantizedWeight((PackedPart(f, torch.from_numpy(d), width),)) for f, d in pairs]
    )
    assert [p.format for p in weight.parts] == [PackedFormat.Q4_K, PackedFormat.Q6_K]
    assert (weight.out_features, weight.formats) == (96, "Q4_K+Q6_K")
    reference = torch.cat([reference_weight(d, f) for f, d in pairs])
    bias = torch.randn(96)
    x = torch.randn(2, 3, width)
    exact = dataclasses.replace(kernel, int8_activations=False)
    expected = x @ reference.T + bias
    ours = exact(x.to(torch.bfloat16), weight, bias.to(torch.bfloat16))
    assert ours.shape == (2, 3, 96) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max())
    assert torch.allclose(exact(x, weight, bias), expected, atol=1e-5 * expected.abs().max())


def test_a_shape_the_kernel_cannot_take_is_refused(kernel):
    with pytest.raises(ValueError, match="not a whole number"):
        PackedPart(PackedFormat.Q4_K, torch.zeros(2, 144, dtype=torch.uint8), 300)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 36\]"):
        PackedPart(PackedFormat.Q4_0, torch.zeros(2, 40, dtype=torch.uint8), 64)
    zeros = torch.zeros(2, 68, dtype=torch.uint8)
    weight = QuantizedWeight((PackedPart(PackedFormat.Q8_0, zeros, 64),))
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        kernel(torch.zeros(1, 32), weight)


def _all_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    batch = runner.prepare([SeqWork(tokens, 0, runner.pool.allocator.allocate(16), True)])
    model = runner.model
    hidden = model.run_layers(
        model.embed(batch.input_ids), batch.positions, runner.pool.layers, batch.meta
    )
    return model.logits(hidden, torch.arange(batch.meta.num_tokens))


def _use_kernel(model: DecoderLM, kernel: QuantizedLinearKernel) -> None:
    model.quantized_kernel = kernel
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is not None:
            module.quantized_kernel = kernel


def _runner(path, quantization: str | None) -> ModelRunner:
    model = load_model(
        resolve_model(str(path)), torch.float32, torch.device("cpu"), 512, quantization=quantization
    )
    pool = KVPool(model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    return ModelRunner(model, pool, torch.device("cpu"))


@pytest.fixture(scope="module")
def mixed_gguf(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_llama_gguf(tiny_llama_dir, path, MIXED_TYPES)


@torch.inference_mode()
def test_a_packed_gguf_model_computes_what_the_dequantized_one_does(kernel, mixed_gguf, caplog):
    """A file the gguf package quantized (three formats in one fused q/k/v, a Q8_0 embedding and
    a Q4_1 LM head): packed, its logits are those of the same file dequantized at load (the
    path checked against transformers); with int8 activations, close."""
    with caplog.at_level(logging.INFO, logger="bulletserve.model.loader"):
        packed = _runner(mixed_gguf, "gguf")
    assert "qkv_proj Q4_0+Q4_1+Q8_0, o_proj Q4_1, gate_up_proj Q4_0, down_proj Q8_0" in caplog.text
    assert "embedding Q8_0; LM head Q4_1" in caplog.text
    assert "projections ours (C), GGUF blocks packed" in packed.kernels()
    assert all(p.dim() == 1 for p in packed.model.parameters())  # only norms stay float
    dequantized = _runner(mixed_gguf, "none")
    assert dequantized.model.weight_bits is None
    weights = [m.quantized for m in packed.model.modules() if getattr(m, "quantized", None)]
    weights.append(packed.model.quantized_lm_head)
    parts = [p for w in weights for p in w.parts]
    bits = sum(p.format.bits_per_weight * p.rows * p.in_features for p in parts)
    assert packed.model.weight_bits == pytest.approx(
        bits / sum(p.rows * p.in_features for p in parts)
    )
    _assert_packed_logits_are_dequantized_ones(packed, dequantized, kernel, 49152)


def test_transformers_reads_a_gguf_file_as_we_do(mixed_gguf, tiny_llama_dir):
    """transformers dequantizes a GGUF file with its own code (the gguf package's) and undoes
    llama.cpp's q/k row permutation itself: our dequantized model of the same file makes its
    greedy tokens."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(mixed_gguf.parent), gguf_file=mixed_gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM(
        str(mixed_gguf),
        tokenizer=str(tiny_llama_dir),  # the file carries no tokenizer
        dtype="float32",
        quantization="none",
        max_model_len=256,
    )
    try:
        prompts = random_prompts(4, seed=21)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for prompt, output in zip(
            prompts, llm.generate(prompts, params, use_tqdm=False), strict=True
        ):
            with torch.inference_mode():
                expected = reference.generate(
                    torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
                )
            assert output.token_ids == expected[0, len(prompt) :].tolist()
    finally:
        llm.close()


@torch.inference_mode()
def test_fp32_logits_are_computed_into_a_lanes_buffer(mixed_gguf):
    """Packed (our kernel) and dequantized (PyTorch's fp32 GEMM), the LM head writes a step's
    logits into the lane's reused memory: the same values as new memory, the same memory on
    the next step."""
    for runner in (_runner(mixed_gguf, "gguf"), _runner(mixed_gguf, "none")):
        model = runner.model
        hidden = torch.randn(
            5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)
        )
        rows = torch.tensor([4, 0, 2])
        buffer = LogitsBuffer()
        first = model.logits(hidden, rows, buffer)
        assert first.dtype == torch.float32 and torch.equal(first, model.logits(hidden, rows))
        again = model.logits(hidden, rows[:2], buffer)
        assert again.data_ptr() == first.data_ptr()
        assert torch.equal(again, model.logits(hidden, rows[:2]))


def _assert_packed_logits_are_dequantized_ones(
    packed: ModelRunner, dequantized: ModelRunner, kernel: QuantizedLinearKernel, vocab: int
) -> None:
    """With fp32 activations the packed model's logits are the dequantized one's; with int8
    ones (where compiled) close, and a greedy choice differs only where the dequantized
    model's runner-up was within that error."""
    tokens = torch.randint(3, vocab, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = _all_logits(dequantized, tokens)
    _use_kernel(packed.model, dataclasses.replace(kernel, int8_activations=False))
    exact = _all_logits(packed, tokens)
    assert float((exact - reference).abs().max()) < 1e-4 * float(reference.abs().max())
    if kernel.int8_activations:
        _use_kernel(packed.model, kernel)
        ours = _all_logits(packed, tokens)
        error = float((ours - reference).abs().max())
        assert error < 8e-2 * float(reference.abs().max())
        chosen = reference.gather(1, ours.argmax(-1, keepdim=True)).squeeze(1)
        assert bool((chosen >= reference.max(-1).values - 2 * error).all())
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.8


def test_quantization_flag(mixed_gguf, tiny_llama_dir):
    from bulletserve.model.loader import resolve_quantization

    cpu = torch.device("cpu")
    gguf_source, folder = resolve_model(str(mixed_gguf)), resolve_model(str(tiny_llama_dir))
    assert resolve_quantization(None, gguf_source, cpu)[0] == "gguf"
    assert resolve_quantization("none", gguf_source, cpu) == ("none", None)
    assert resolve_quantization(None, folder, cpu) == ("none", None)
    with pytest.raises(ValueError, match="needs a .gguf file"):
        resolve_quantization("gguf", folder, cpu)
    with pytest.raises(ValueError, match="--quantization awq: not supported yet"):
        resolve_quantization("awq", gguf_source, cpu)
    with pytest.raises(ValueError, match="--quantization must be one of"):
        resolve_quantization("q4", gguf_source, cpu)


def test_the_embedded_default_is_served_dequantized_unless_asked_packed():
    """The measured decision (docs/benchmarks.md "Quantized models")."""
    from bulletserve.model.loader import resolve_quantization

    embedded, cpu = resolve_model(None), torch.device("cpu")
    assert resolve_quantization(None, embedded, cpu) == ("none", None)
    assert resolve_quantization("gguf", embedded, cpu)[0] == "gguf"


@pytest.mark.parametrize("int8_activations", [True, False])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, int8_activations):
    """Bit for bit, alone or among 1 to 9 other rows: greedy outputs do not depend on the batch."""
    chosen = dataclasses.replace(kernel, int8_activations=int8_activations)
    x = torch.randn(10, 512, generator=torch.Generator().manual_seed(5))
    for fmt in (PackedFormat.Q4_K, PackedFormat.Q8_0, PackedFormat.Q6_K):
        data = torch.from_numpy(random_blocks(fmt, 24, 512))
        weight = QuantizedWeight((PackedPart(fmt, data, 512),))
        together = chosen(x, weight)
        for rows in range(1, 10):
            assert torch.equal(chosen(x[:rows], weight), together[:rows])
        assert torch.equal(chosen(x[7:8], weight), together[7:8])


# A random 2-layer Llama (vocabulary 512) made W8A8 (int8, a scale per output channel), W8A16
# and W4A16 (int8 and int4 in int32 words, a scale per 32 inputs) by llmcompressor 0.14.0.1
# (scripts/make_compressed_tensors.py --tiny-random).
FIXTURES = Path(__file__).parent / "fixtures"
W8A8_TINY = FIXTURES / "w8a8-tiny-llama"
COMPRESSED = [(W8A8_TINY, "Q8_0"), (FIXTURES / "w8a16-g32-tiny-llama", "Q8_0")]
COMPRESSED += [(FIXTURES / "w4a16-g32-tiny-llama", "Q4_0")]


def _compressed_weight(folder: Path, stem: str) -> torch.Tensor:
    """A matrix of the checkpoint as compressed-tensors unpacks it, times its scales."""
    from compressed_tensors.compressors import unpack_from_int32

    tensors = load_file(str(folder / "model.safetensors"))
    values = tensors.get(f"{stem}.weight")
    if values is None:
        bits = json.loads((folder / "config.json").read_text())["quantization_config"]
        bits = bits["config_groups"]["group_0"]["weights"]["num_bits"]
        shape = torch.Size(tensors[f"{stem}.weight_shape"].tolist())
        values = unpack_from_int32(tensors[f"{stem}.weight_packed"], bits, shape)
    scale = tensors[f"{stem}.weight_scale"].float()
    return values.float() * scale.repeat_interleave(values.shape[1] // scale.shape[1], dim=1)


@torch.inference_mode()
@pytest.mark.parametrize("folder, fmt", COMPRESSED, ids=lambda v: getattr(v, "name", v))
def test_a_compressed_tensors_checkpoint_runs_packed(kernel, caplog, folder, fmt):
    """llmcompressor's checkpoints: detected from the config, their integer values and scales
    kept exactly (as Q8_0 or Q4_0 blocks), and their logits those of the checkpoint
    dequantized at load (int8 activations: close, greedy choices nearly all alike)."""
    with caplog.at_level(logging.INFO, logger="bulletserve.model.loader"):
        packed = _runner(folder, None)
    assert f"weights (--quantization compressed-tensors): layers 0-1: qkv_proj {fmt}" in caplog.text
    down = packed.model.layers[1].mlp.down_proj.quantized
    expected = _compressed_weight(folder, "model.layers.1.mlp.down_proj")
    assert torch.equal(kernel.dequantize_weight(down), expected)
    _assert_packed_logits_are_dequantized_ones(packed, _runner(folder, "none"), kernel, 512)


def test_compressed_tensors_schemes_not_served_are_refused_by_name(tmp_path, tiny_llama_dir):
    from bulletserve.model.loader import resolve_quantization

    cpu = torch.device("cpu")
    source = resolve_model(str(W8A8_TINY))
    assert resolve_quantization(None, source, cpu)[0] == "compressed-tensors"
    assert resolve_quantization("none", source, cpu) == ("none", None)
    with pytest.raises(ValueError, match="needs a .gguf file"):
        resolve_quantization("gguf", source, cpu)
    with pytest.raises(ValueError, match="needs a compressed-tensors checkpoint"):
        resolve_quantization("compressed-tensors", resolve_model(str(tiny_llama_dir)), cpu)
    with pytest.raises(ValueError, match="not sharded over tensor-parallel ranks"):
        resolve_quantization("compressed-tensors", source, cpu, ranks=2)
    for change, named in [
        ({"type": "float"}, "8-bit float weights"),
        ({"strategy": "group", "group_size": 48}, "weight groups of 48, not a multiple of 32"),
        ({"strategy": "tensor"}, "weights quantized per tensor"),
        ({"symmetric": False}, "asymmetric weights"),
    ]:
        folder = tmp_path / named.replace(" ", "-")
        shutil.copytree(W8A8_TINY, folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=named):
            resolve_quantization(None, resolve_model(str(folder)), cpu)


@pytest.mark.parametrize("policy", ["chunked", "bullet"])
@pytest.mark.parametrize("checkpoint", ["gguf", "compressed-tensors"])
def test_the_server_answers_on_each_packed_format(policy, checkpoint, mixed_gguf, tmp_path, kernel):
    """`bullet serve` on a packed GGUF file and on a W8A8 checkpoint (with the default model's
    tokenizer), under both policies: completions of the requested length."""
    import httpx

    from bulletserve.engine.async_engine import AsyncEngine
    from bulletserve.engine.config import EngineConfig
    from bulletserve.model.tokenizer import load_tokenizer
    from tests.server.harness import running_app

    model = mixed_gguf if checkpoint == "gguf" else W8A8_TINY
    load_tokenizer(None).save_pretrained(tmp_path)
    config = EngineConfig(
        model=str(model), tokenizer=str(tmp_path), policy=policy, max_model_len=256
    )
    engine = AsyncEngine(config)
    try:
        with running_app(engine) as url:
            body = {"model": "tiny", "prompt": [5, 17, 301, 44, 9], "max_tokens": 6}
            body |= {"temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60, trust_env=False)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 6
    finally:
        engine.shutdown()
