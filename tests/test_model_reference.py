"""Our model code against transformers' reference implementation on tiny random models."""

from __future__ import annotations

import pytest
import torch

from bulletserve.engine.model_runner import ModelRunner, SeqWork
from bulletserve.kv.pool import KVPool
from bulletserve.model import loader
from bulletserve.model.cpu_kernels import (
    blocked_linear_kernel,
    onednn_linear_kernel,
    prefill_attention_kernel,
)
from bulletserve.model.loader import load_model
from bulletserve.model.source import resolve_model
from bulletserve.model.triton_attention import TritonDecodeAttention, TritonPrefillAttention
from tests.tiny_models import make_hf_model

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama": {},
    "llama-rope-llama3-tied": {"rope_scaling": LLAMA31_ROPE, "tie_word_embeddings": True},
    "qwen2": {},
    "qwen3": {},
}


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def _all_logits(runner: ModelRunner, works: list[SeqWork]) -> torch.Tensor:
    """Logits for every new token of the step (the runner itself returns only sampled rows)."""
    batch = runner.prepare(works)
    model = runner.model
    hidden = model.run_layers(
        model.embed(batch.input_ids), batch.positions, runner.pool.layers, batch.meta
    )
    return model.logits(hidden, torch.arange(batch.meta.num_tokens))  # padding rows dropped


@pytest.fixture(params=list(CASES))
def pair(request, tmp_path):
    name = request.param
    family = name.split("-")[0]
    reference = make_hf_model(family, tmp_path, seed=3, **CASES[name])
    ours = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), 512)
    pool = KVPool(ours.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    return reference, ModelRunner(ours, pool, torch.device("cpu"))


@torch.inference_mode()
def test_single_prompt_logits_match(pair):
    reference, runner = pair
    tokens = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(0))
    blocks = runner.pool.allocator.allocate(10)
    ours = _all_logits(runner, [SeqWork(tokens.tolist(), 0, blocks, True)])
    expected = reference(tokens.unsqueeze(0)).logits[0]
    assert _relative_error(ours, expected) < 1e-4


@torch.inference_mode()
@pytest.mark.parametrize("kernels", ["ours-onednn", "ours-blocked", "pytorch", "triton"])
def test_ragged_batch_from_paged_cache_matches(pair, kernels, monkeypatch, tmp_path):
    """A fresh prefill, a chunk after a cached prefix, and decodes, all in one step; through our
    CPU kernels (prefill and decode attention, fused norms, RoPE, SiLU, packed projections by
    oneDNN or our blocked GEMM, forced on whatever the load-time timings chose), through
    PyTorch ops alone, and through our Triton attention kernels (the CUDA path; here in
    Triton's interpreter) with PyTorch ops around them."""
    reference, runner = pair
    getter = {"ours-onednn": onednn_linear_kernel, "ours-blocked": blocked_linear_kernel}
    ours = kernels in getter
    cpu = torch.device("cpu")
    linear = getter[kernels](torch.float32, cpu) if ours else None
    config = runner.model.config
    prefill_kernel = prefill_attention_kernel(
        torch.float32, config.head_dim, config.num_heads // config.num_kv_heads, cpu
    )
    if ours and (
        runner.decode_kernel is None
        or prefill_kernel is None
        or runner.model.norm.ops is None
        or linear is None
    ):
        pytest.skip("our CPU kernels could not be built here")
    # The model is loaded again with the packed kernel forced on or off: packing is one-way.
    monkeypatch.setattr(loader, "packed_linear_kernel", lambda *_: linear)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), 512)
    assert (model.packed_linear is not None) == ours
    runner = ModelRunner(model, runner.pool, cpu)
    if ours:  # forced on, whatever the load-time timing against SDPA chose
        runner.prefill_kernel = prefill_kernel
    if kernels in ("pytorch", "triton"):
        runner.decode_kernel = runner.prefill_kernel = runner.kv_writer = None
        runner.model.use_fused_ops(None)
    if kernels == "triton":
        if torch.cuda.is_available():
            pytest.skip("Triton runs on CUDA there, not in its interpreter on these CPU tensors")
        group = config.num_heads // config.num_kv_heads
        runner.decode_kernel = TritonDecodeAttention(config.head_dim, group, sm_count=8)
        runner.prefill_kernel = TritonPrefillAttention(config.head_dim, group)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (11, 23, 9, 30)]
    tables = [runner.pool.allocator.allocate(-(-len(s) // 4)) for s in seqs]
    # First step: cache the prefixes of sequences 1-3 (lengths 13, 8, 29); sequence 0 waits.
    prefixes = {1: 13, 2: 8, 3: 29}
    _all_logits(runner, [SeqWork(seqs[i][:n], 0, tables[i], False) for i, n in prefixes.items()])
    # Second step: seq 0 from scratch, seq 1 a 10-token chunk after its prefix, 2 and 3 decode.
    works = [
        SeqWork(seqs[0], 0, tables[0], True),
        SeqWork(seqs[1][13:], 13, tables[1], True),
        SeqWork(seqs[2][8:9], 8, tables[2], True),
        SeqWork(seqs[3][29:30], 29, tables[3], True),
    ]
    ours = _all_logits(runner, works)
    # The runner lays prefills (query length > 1) first, then decodes, in the given order.
    expected = torch.cat(
        [
            reference(torch.tensor([seqs[0]])).logits[0],
            reference(torch.tensor([seqs[1]])).logits[0, 13:],
            reference(torch.tensor([seqs[2][:9]])).logits[0, 8:],
            reference(torch.tensor([seqs[3]])).logits[0, 29:],
        ]
    )
    assert _relative_error(ours, expected) < 1e-4


@torch.inference_mode()
def test_sharded_safetensors_folder_loads(tmp_path):
    reference = make_hf_model("llama", tmp_path, seed=4, max_shard_size="2MB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), 512)
    pool = KVPool(ours.config, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    runner = ModelRunner(ours, pool, torch.device("cpu"))
    tokens = list(range(100, 120))
    logits = _all_logits(runner, [SeqWork(tokens, 0, pool.allocator.allocate(5), True)])
    assert _relative_error(logits, reference(torch.tensor([tokens])).logits[0]) < 1e-4


def test_unsupported_architecture_and_missing_weights_are_named(tmp_path):
    import json

    from bulletserve.model.config import UnsupportedModelError
    from bulletserve.model.loader import load_config
    from bulletserve.model.source import ModelNotFoundError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_config(resolve_model(str(tmp_path)))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


@torch.inference_mode()
def test_padded_rows_change_no_logit_and_fill_no_cache_slot(pair):
    """A CPU step in bf16 pads its rows (engine.runner.padded_rows); in fp32 it does not, so
    here padding is turned on by hand: a step of a 37-token prompt beside three decodes (40
    rows, computed as 48) gives the same logits as unpadded and writes only its 40 slots."""
    _, runner = pair
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (37, 9, 14, 6)]
    tables = [runner.pool.allocator.allocate(10) for _ in seqs]
    runner.pool.kv.zero_()
    cached = [
        SeqWork(seq[:-1], 0, table, False) for seq, table in zip(seqs[1:], tables[1:], strict=True)
    ]
    runner.execute(cached)
    step = [SeqWork(seqs[0], 0, tables[0], True)]
    step += [
        SeqWork(seq[-1:], len(seq) - 1, table, True)
        for seq, table in zip(seqs[1:], tables[1:], strict=True)
    ]
    results = {}
    for pad in (False, True):
        runner.pad_rows = pad
        assert runner.prepare(step).input_ids.shape[0] == (48 if pad else 40)
        logits, order = runner.execute(step)
        slots_written = int(runner.pool.layers[0][0].flatten(1).any(dim=1).sum())
        results[pad] = logits, order, slots_written
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    assert results[True][1] == results[False][1] == [0, 1, 2, 3]
    assert results[True][2] == results[False][2] == sum(len(seq) for seq in seqs)
