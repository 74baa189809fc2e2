"""The engine end to end on a tiny random model (fp32): invariance, preemption, stops, aborts."""

from __future__ import annotations

import random

import pytest

from bulletserve import LLM, SamplingParams
from bulletserve.bookkeeping.record import read_step_log
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.engine import LLMEngine
from tests.tiny_models import GREEDY, TINY_LLAMA_BLOCK_BYTES, random_prompts, tiny_llm


@pytest.mark.parametrize(
    "settings",
    [
        {"policy": "chunked", "chunked_prefill_size": 2048},
        {"policy": "chunked", "chunked_prefill_size": 16},
        {"policy": "chunked", "chunked_prefill_size": 5},
        {"policy": "prefill-first"},
        {"policy": "chunked", "kv_cache_memory": str(20 * TINY_LLAMA_BLOCK_BYTES)},
        {"policy": "prefill-first", "kv_cache_memory": str(20 * TINY_LLAMA_BLOCK_BYTES)},
    ],
    ids=[
        "chunked-2048",
        "chunked-16",
        "chunked-5",
        "prefill-first",
        "chunked-preempt",
        "pf-preempt",
    ],
)
def test_greedy_output_independent_of_batch_policy_and_preemption(
    tiny_llama_dir, alone_outputs, settings
):
    llm = tiny_llm(tiny_llama_dir, **settings)
    outputs = llm.generate(random_prompts(10, seed=5), GREEDY)
    assert [o.token_ids for o in outputs] == alone_outputs
    if "kv_cache_memory" in settings:
        assert sum(o.num_preemptions for o in outputs) > 0
    assert llm.engine.pool.allocator.num_used == 0


def test_stale_memory_in_the_pool_never_leaks_into_attention(tiny_llama_dir, alone_outputs):
    """Freed blocks keep old values; a partly filled last block must not be read (NaN * 0)."""
    llm = tiny_llm(tiny_llama_dir)
    pool = llm.engine.pool
    pool.kv.fill_(float("nan"))
    pool.kv[:, :, : pool.block_size].zero_()  # the null block stays zero
    outputs = llm.generate(random_prompts(10, seed=5), GREEDY)
    assert [o.token_ids for o in outputs] == alone_outputs


def test_a_hundred_requests_through_a_small_pool_all_finish(tiny_llama_dir):
    """Enough requests through a pool of a few prompts' blocks that preemption churns (a
    hundred: 300 took 15 s of the suite and found nothing more)."""
    llm = tiny_llm(
        tiny_llama_dir, kv_cache_memory=str(24 * TINY_LLAMA_BLOCK_BYTES), chunked_prefill_size=64
    )
    rng = random.Random(7)
    prompts = random_prompts(100, seed=8, low=1, high=120)
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 40), temperature=rng.choice([0, 0.8]), ignore_eos=True
        )
        for _ in prompts
    ]
    outputs = llm.generate(prompts, params)
    assert len(outputs) == 100
    for output, p in zip(outputs, params, strict=True):
        assert output.finished and output.finish_reason == "length"
        assert len(output.token_ids) == p.max_tokens
    allocator = llm.engine.pool.allocator
    assert allocator.num_free == allocator.num_blocks
    assert llm.engine.num_preemptions > 0
    assert not llm.engine.life.requests


def test_seeded_sampling_reproduces_whatever_the_batch(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    prompt = random_prompts(1, seed=9)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate([prompt, *random_prompts(5, seed=10)], [seeded] + [others] * 5)
    assert batch[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone


def test_top_k_one_is_greedy_and_logprobs_are_consistent(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    prompt = random_prompts(1, seed=11)[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    top1 = llm.generate(
        [prompt],
        SamplingParams(max_tokens=8, temperature=1.5, top_k=1, logprobs=3, ignore_eos=True),
    )[0]
    assert top1.token_ids == greedy[0].token_ids
    assert len(top1.logprobs) == 8
    for token, entry in zip(top1.token_ids, top1.logprobs, strict=True):
        assert entry.token_id == token
        assert len(entry.top) == 3
        assert entry.top[0][0] == token  # the greedy token is the most likely one
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
        assert entry.logprob == pytest.approx(entry.top[0][1])


def test_top_p_keeps_sampling_within_the_nucleus(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    prompt = random_prompts(1, seed=12)[0]
    tiny_p = SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert (
        llm.generate([prompt], tiny_p)[0].token_ids == llm.generate([prompt], greedy)[0].token_ids
    )


def test_stop_string_truncates_the_text(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    prompt = "Hello there"
    full = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), full.text
    stopped = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]


def test_stop_token_ids_and_max_model_len(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, max_model_len=32)
    prompt = random_prompts(1, seed=13, low=20, high=20)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 32
    third = out.token_ids[2]
    stop_at = SamplingParams(max_tokens=100, temperature=0, stop_token_ids=[third])
    stopped = llm.generate([prompt], stop_at)[0]
    assert (
        stopped.finish_reason == "stop"
        and stopped.token_ids == out.token_ids[: out.token_ids.index(third) + 1]
    )


def test_abort_frees_blocks_at_once(tiny_llama_dir):
    engine: LLMEngine = tiny_llm(tiny_llama_dir).engine
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(4, seed=14)]
    for _ in range(3):
        engine.step()
    assert engine.pool.allocator.num_used > 0
    for request_id in ids:
        engine.abort_request(request_id)
    outputs = engine.step()
    assert {o.request_id for o in outputs if o.finish_reason == "abort"} == set(ids)
    assert engine.pool.allocator.num_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
    ],
)
def test_bad_sampling_params_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_prompt_too_long_is_rejected_and_engine_stays_usable(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, max_model_len=16)
    with pytest.raises(ValueError, match="the prompt has 40 tokens; --max-model-len is 16"):
        llm.generate([[5] * 4, [5] * 40], GREEDY)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[5] * 4], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_a_vanishing_temperature_samples_the_argmax(tiny_llama_dir):
    """A temperature of 1e-300 (0 in float32) samples the argmax, the limit as the temperature
    goes to 0, not a NaN distribution."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    prompt = random_prompts(1, seed=15)[0]
    tiny = SamplingParams(max_tokens=12, temperature=1e-300, seed=1, ignore_eos=True)
    assert llm.generate([prompt], tiny)[0].token_ids == llm.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"slo_ttft_per_token_ms": 0.5}, None),
        ({"slo_ttft_per_token_ms": 0}, r"--slo-ttft-per-token-ms must be in \[0.001, "),
        ({"slo_ttft_per_token_ms": 5e-324}, r"--slo-ttft-per-token-ms must be in \[0.001, "),
        ({"slo_tpot_ms": -1.0}, r"--slo-tpot-ms must be in \[0.001, "),
        ({"slo_tpot_ms": float("inf")}, r"--slo-tpot-ms must be in \[0.001, "),
        ({"slo_ttft_base_ms": -1.0}, r"--slo-ttft-base-ms must be in \[0, "),
    ],
)
def test_slo_settings_are_checked(settings, message):
    if message is None:
        assert EngineConfig(**settings).slo_ttft_per_token_ms == 0.5  # sub-millisecond is fine
        return
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_tokenizer_flag_takes_a_tokenizer_folder(tmp_path):
    """`--tokenizer`: a folder of `save_pretrained` files stands in for the model's tokenizer
    (how a dummy preset runs where the embedded model is not installed)."""
    from bulletserve.model.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    load_tokenizer(None).save_pretrained(str(folder))
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            load_format="dummy",
            tokenizer=str(folder),
            dtype="float32",
            max_model_len=64,
            device="cpu",
        )
    )
    assert engine.tokenizer.name_or_path == str(folder)
    with pytest.raises(ValueError, match="--tokenizer .* does not exist"):
        EngineConfig(tokenizer=str(tmp_path / "missing"))
    assert engine.tokenize("hello world") == load_tokenizer(None).encode("hello world")


@pytest.mark.parametrize(("policy", "chunk"), [("prefill-first", None), ("chunked", 16)])
def test_the_single_lane_engine_writes_a_step_log(tiny_llama_dir, tmp_path, policy, chunk):
    log = tmp_path / "steps.jsonl"
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        policy=policy,
        chunked_prefill_size=chunk,
        num_threads=2,
        step_log=str(log),
    )
    prompts = random_prompts(6, seed=31)
    outputs = llm.generate(prompts, GREEDY)
    llm.engine.close()
    records = read_step_log(log)
    # Every prompt token and every fed-back output token was computed in a logged step.
    fed_back = sum(len(o.token_ids) - 1 for o in outputs)
    assert sum(r.tokens for r in records) == sum(len(p) for p in prompts) + fed_back
    assert sum(r.decode_rows for r in records) == fed_back
    for r in records:
        assert r.measured_s > 0 and r.batch_size >= 1
        assert r.split == (2 if r.prefill_tokens else 0, 2 if r.decode_rows else 0)
        # The step as the performance model describes it (a fused step: one prefill row per
        # decode, on top of its context).
        es = r.state
        if r.lane == "decode":
            assert (es.decode_batch, es.decode_units, es.prefill_lens) == (r.decode_rows, 2, ())
        else:
            assert (es.prefill_tokens, es.prefill_units) == (r.tokens, 2)
            assert len(es.prefill_lens) == r.batch_size
        if not r.prefill_tokens:
            assert r.lane == "decode"
        else:
            assert r.lane == ("hybrid" if r.decode_rows else "prefill")
    lanes = {r.lane for r in records}
    assert {"prefill", "decode"} <= lanes
    if policy == "chunked":
        assert "hybrid" in lanes


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(False, False, "float32"), (True, False, "bfloat16"), (False, True, "bfloat16")],
)
def test_auto_dtype_on_a_cpu_is_bf16_only_where_the_cpu_has_it(
    tiny_llama_dir, monkeypatch, avx512_bf16, amx, expected
):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, cpu_warmup_rows=0)
    assert next(llm.engine.model.parameters()).dtype == getattr(torch, expected)
    [out] = llm.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out.token_ids) == 2


def test_an_unknown_dtype_names_the_flag():
    import torch

    from bulletserve.model.loader import resolve_dtype

    with pytest.raises(ValueError, match="--dtype must be auto or one of"):
        resolve_dtype("int3", torch.device("cpu"))
    assert resolve_dtype("fp32", torch.device("cpu")) == torch.float32


def test_the_offline_api_takes_and_returns_what_vllms_does(tiny_llama_dir):
    """`generate(prompts, sampling_params=...)`, `out.outputs[i].text / token_ids / logprobs /
    finish_reason`, and `SamplingParams(n=...)`: a prompt's n sequences, seeded ones from seed
    + k, as vLLM's parallel sampling."""
    llm = tiny_llm(tiny_llama_dir)
    prompts = random_prompts(2, seed=31)
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, logprobs=1)
    try:
        outputs = llm.generate(prompts, sampling_params=params, use_tqdm=False)
        assert len(outputs) == 2
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.prompt_token_ids == prompt
            assert [o.index for o in output.outputs] == [0, 1, 2]
            assert len({tuple(o.token_ids) for o in output.outputs}) > 1  # seed, seed + 1, ...
            for sequence in output.outputs:
                assert len(sequence.token_ids) == 6 and sequence.finish_reason == "length"
                assert sequence.cumulative_logprob == pytest.approx(
                    sum(lp.logprob for lp in sequence.logprobs)
                )
            assert output.outputs[0].text == output.text  # the first is the output's own
        # Sequence k is the request a prompt gets alone with seed + k.
        alone = llm.generate([prompts[0]], SamplingParams(max_tokens=6, seed=6), use_tqdm=False)
        assert alone[0].token_ids == outputs[0].outputs[1].token_ids
        with pytest.raises(ValueError, match="n=2"):
            llm.engine.add_request(prompts[0], SamplingParams(n=2))
        with pytest.raises(ValueError, match="n must be >= 1"):
            SamplingParams(n=0)
    finally:
        llm.engine.close()


def test_a_hugging_face_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    """`--model ORG/NAME` as vLLM takes it: the snapshot in the Hugging Face cache's own layout
    (`models--ORG--NAME/snapshots/REV`, `refs/main`), found with local files only and named by
    its id; an id not cached says how to fetch it."""
    import huggingface_hub.constants

    from bulletserve.model.source import ModelNotFoundError, resolve_model
    from tests.tiny_models import make_hf_model

    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    commit = "0123abcd" * 5  # the cache names snapshots by their full commit hash
    snapshot = repo / "snapshots" / commit
    make_hf_model("llama", snapshot, seed=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model("tiny-org/tiny-llama")
    assert source.path == snapshot and source.name == "tiny-org/tiny-llama"
    assert resolve_model("tiny-org/tiny-llama", revision=commit).path == snapshot
    llm = tiny_llm("tiny-org/tiny-llama")
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == 12
    finally:
        llm.engine.close()
    with pytest.raises(ModelNotFoundError, match="hf download tiny-org/absent"):
        resolve_model("tiny-org/absent")
    with pytest.raises(ModelNotFoundError, match="--revision v9"):
        resolve_model("tiny-org/tiny-llama", revision="v9")
    # --load-format dummy of the id (as vLLM's): its config.json's shape, random weights.
    dummy = resolve_model("tiny-org/tiny-llama", "dummy")
    assert (dummy.load_format, dummy.path, dummy.name) == (
        "dummy",
        snapshot,
        "dummy-tiny-org/tiny-llama",
    )


def test_dummy_weights_take_a_model_folders_shape(tiny_llama_dir):
    """`--load-format dummy --model FOLDER`: the folder's config and tokenizer, random weights
    (not the folder's); neither a preset nor a folder with a config.json is refused."""
    import torch

    from bulletserve.model.loader import load_config, load_model
    from bulletserve.model.source import ModelNotFoundError, resolve_model

    real = resolve_model(str(tiny_llama_dir))
    dummy = resolve_model(str(tiny_llama_dir), "dummy")
    assert dummy.name == f"dummy-{tiny_llama_dir.name}"
    assert load_config(dummy) == load_config(real)
    cpu = torch.device("cpu")
    weights = [load_model(s, torch.float32, cpu, 64).embed_tokens.weight for s in (real, dummy)]
    assert weights[0].shape == weights[1].shape and not torch.equal(*weights)
    llm = tiny_llm(str(tiny_llama_dir), load_format="dummy")
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == 12
    finally:
        llm.engine.close()
    with pytest.raises(ModelNotFoundError, match="a preset .* or a model folder"):
        resolve_model("no-such-thing", "dummy")


def test_serve_takes_the_model_as_vllm_serve_does(capsys):
    """`bullet serve MODEL` as `vllm serve MODEL`; given twice, differently, it is refused."""
    from bulletserve.cli import main

    assert main(["serve", "tiny-org/not-cached"]) == 2
    assert "hf download tiny-org/not-cached" in capsys.readouterr().err
    assert main(["serve", "a/b", "--model", "c/d"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_flags_a_vllm_user_types(capsys, tmp_path):
    """--trust-remote-code accepted (it changes nothing here), a --quantization not built yet
    refused by name with what runs instead, --uvicorn-log-level as --log-level, --chat-template
    a file or inline, and an unknown flag names the closest known one."""
    from bulletserve.cli import CLIError, build_parser, main
    from bulletserve.cli.serve import _chat_template

    assert main(["serve", "--trust-remote-code", "tiny-org/not-cached"]) == 2
    assert "hf download" in capsys.readouterr().err  # parsed, and on to the model
    assert main(["serve", "--quantization", "awq"]) == 2
    error = capsys.readouterr().err
    assert "--quantization awq: not supported yet; supported: gguf" in error
    assert main(["serve", "--quantization", "q4"]) == 2
    assert "--quantization must be one of gguf, compressed-tensors, none" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--uvicorn-log-level", "warning"])
    assert args.log_level == "warning"
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    assert _chat_template(str(template)) == "{{ messages }}"
    assert _chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(CLIError, match="no such file"):
        _chat_template(str(tmp_path / "absent.jinja"))
    with pytest.raises(SystemExit):
        main(["serve", "--max-num-seqz", "4"])
    assert "did you mean --max-num-seqs?" in capsys.readouterr().err
