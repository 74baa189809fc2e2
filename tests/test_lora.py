"""LoRA adapters against PEFT: adapters made by `peft` on the tiny Llama (ranks 4 to 64, rsLoRA,
attention and MLP targets, A and B both random), our greedy texts equal to transformers + PEFT
in fp32, each adapter alone and all of them mixed with base requests in one step; what we do
not serve is refused at load naming the field; the prefix cache is never shared across
adapters or across a reload."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from bulletserve import LLM, LoRARequest, SamplingParams
from bulletserve.engine.async_engine import AsyncEngine
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.lora import UnknownAdapterError
from bulletserve.model.peft import AdapterError
from tests.server.harness import running_app
from tests.tiny_models import random_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rsLoRA, targets)
ADAPTERS = {
    "attn-r4": (4, 8, False, ATTENTION),
    "mlp-r16": (16, 16, False, MLP),
    "all-r64-rs": (64, 32, True, "all-linear"),
}


def _make_adapter(base_dir, folder, rank, alpha, rslora, targets, seed):
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets,
        init_lora_weights=False,  # B random too, so that every adapter changes the output
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.5 / rank**0.5)
    peft_model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: _make_adapter(tiny_llama_dir, root / name, *settings, seed=index)
        for index, (name, settings) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def peft_outputs(tiny_llama_dir, adapters):
    """Greedy tokens of transformers + PEFT (fp32) per adapter (None: the base) and prompt."""
    import transformers
    from peft import PeftModel

    prompts = random_prompts(3, seed=3, low=5, high=40)
    outputs = {}
    for name in [None, *adapters]:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(tiny_llama_dir), dtype=torch.float32
        )
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name]))
        model.eval()
        texts = []
        for prompt in prompts:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=MAX_TOKENS,
                    min_new_tokens=MAX_TOKENS,
                    do_sample=False,
                )
            texts.append(out[0, len(prompt) :].tolist())
        outputs[name] = texts
    return prompts, outputs


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir, adapters):
    modules = tuple(f"{name}={path}" for name, path in list(adapters.items())[:2])
    llm = _lora_llm(tiny_llama_dir, lora_modules=modules)
    yield llm
    llm.close()


def test_each_adapter_alone_equals_peft(lora_llm, adapters, peft_outputs):
    prompts, expected = peft_outputs
    (line,) = [line for line in lora_llm.engine.describe() if line.startswith("LoRA adapters")]
    assert "attn-r4 (rank 4, from" in line and "mlp-r16 (rank 16" in line
    assert len({tuple(map(tuple, texts)) for texts in expected.values()}) == len(expected)
    base = lora_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in base] == expected[None]
    for index, (name, path) in enumerate(adapters.items()):
        request = LoRARequest(name, index + 1, str(path))
        got = lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=request)
        assert [o.token_ids for o in got] == expected[name], name


def test_every_adapter_and_the_base_mixed_in_one_step(lora_llm, adapters, peft_outputs):
    _mixed(lora_llm, adapters, peft_outputs)


@pytest.mark.parametrize("policy", ["prefill-first", "bullet"])
def test_mixed_under_the_other_policies(tiny_llama_dir, adapters, peft_outputs, policy):
    """Prefill-first's whole prompts, and Bullet's two lanes (a prefill pass in layer groups
    beside the decode lane's steps) give PEFT's texts too; so do steps held to one adapter at
    a time (--max-loras 1: the queue waits for the running adapter's requests to end)."""
    settings: dict = {"prefill_layers_per_step": 1} if policy == "bullet" else {"max_loras": 1}
    llm = _lora_llm(tiny_llama_dir, policy=policy, **settings)
    try:
        _mixed(llm, adapters, peft_outputs)
        if "max_loras" in settings:
            engine = llm.engine
            for index, name in enumerate(["attn-r4", "mlp-r16", None, "attn-r4"]):
                request = None if name is None else _named(name, adapters)
                engine.add_request([5, 6, 7 + index], GREEDY, lora_request=request)
            seen = set()
            for _ in range(200):
                if not engine.has_unfinished():
                    break
                engine.step()
                running = {r.lora.name for r in engine.running if r.lora is not None}
                assert len(running) <= 1
                seen |= running
            assert seen == {"attn-r4", "mlp-r16"} and not engine.has_unfinished()
    finally:
        llm.close()


def _mixed(llm, adapters, peft_outputs):
    prompts, expected = peft_outputs
    names = [None, *adapters]
    pairs = [(prompt, name) for name in names for prompt in prompts]
    requests = [
        None if name is None else LoRARequest(name, 1, str(adapters[name])) for _, name in pairs
    ]
    got = llm.generate(
        [prompt for prompt, _ in pairs], GREEDY, use_tqdm=False, lora_request=requests
    )
    for (prompt, name), output in zip(pairs, got, strict=True):
        assert output.token_ids == expected[name][prompts.index(prompt)], name
    assert llm.engine.pool.allocator.num_used == 0


def test_the_prefix_cache_is_never_shared_across_adapters_or_a_reload(lora_llm, adapters):
    engine = lora_llm.engine
    prompt = random_prompts(1, seed=41, low=64, high=64)[0]
    first = lora_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = lora_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the base shares its own prefix
    name = "attn-r4"
    one = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_named(name, adapters))
    assert one[0].num_cached_tokens == 0
    two = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_named(name, adapters))
    assert two[0].num_cached_tokens > 0
    engine.lora.load(name, str(adapters["mlp-r16"]))  # the name reloaded, another adapter
    three = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_named(name, adapters))
    assert three[0].num_cached_tokens == 0
    engine.lora.load(name, str(adapters[name]))


def _lora_llm(model_dir, **settings) -> LLM:
    """The tiny Llama in fp32 serving adapters up to rank 64."""
    return LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_lora_rank=64,
        **settings,
    )


def _named(name, adapters):
    return LoRARequest(name, 1, str(adapters[name]))


def test_unknown_names_and_adapters_we_do_not_serve_are_refused(
    tiny_llama_dir, lora_llm, adapters, tmp_path
):
    with pytest.raises(UnknownAdapterError, match="no LoRA adapter named 'nope'"):
        lora_llm.engine.add_request([5, 6, 7], GREEDY, lora_request="nope")
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            plain.generate(
                [[5, 6]], GREEDY, use_tqdm=False, lora_request=_named("attn-r4", adapters)
            )
    finally:
        plain.close()
    registry = lora_llm.engine.lora
    source = adapters["attn-r4"]

    def broken(change=None, drop=None, extra=None):
        folder = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        shutil.copytree(source, folder)
        settings = json.loads((folder / "adapter_config.json").read_text())
        settings.update(change or {})
        (folder / "adapter_config.json").write_text(json.dumps(settings))
        if drop:
            (folder / drop).unlink()
        if extra:
            (folder / extra).write_bytes(b"")
        return folder

    for folder, message in (
        (broken({"use_dora": True}), "use_dora"),
        (broken({"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (broken({"bias": "all"}), "bias"),
        (broken({"r": 128}), "above --max-lora-rank 64"),
        (broken({"r": 8}), "do not fit"),
        (broken(drop="adapter_model.safetensors", extra="adapter_model.bin"), "pickled"),
        (broken(drop="adapter_config.json"), "no adapter_config.json"),
    ):
        with pytest.raises(AdapterError, match=message):
            registry.load("broken", str(folder))


def test_the_server_serves_an_adapter_by_its_model_name(tiny_llama_dir, adapters, peft_outputs):
    """A request's `model` names its adapter (its output the one PEFT gives); /v1/models lists
    each adapter with its path and base; an unknown name is a 404 in OpenAI's format; with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING adapters are loaded and unloaded at run time (else the
    endpoints refuse, naming it)."""
    prompts, expected = peft_outputs
    name = "mlp-r16"
    engine = AsyncEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_model_len=256,
            enable_lora=True,
            max_lora_rank=64,
            lora_modules=(f"{name}={adapters[name]}",),
        )
    )
    try:
        with running_app(engine, lora_modules={name: str(adapters[name])}) as url:
            with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
                models = client.get("/v1/models").json()["data"]
                assert [(m["id"], m["root"], m.get("parent")) for m in models[1:]] == [
                    (name, str(adapters[name]), "tiny")
                ]
                for model, want in ((name, expected[name]), ("tiny", expected[None])):
                    body = {
                        "model": model, "prompt": prompts[0], "max_tokens": MAX_TOKENS,
                        "temperature": 0, "ignore_eos": True,
                    }  # fmt: skip
                    reply = client.post("/v1/completions", json=body)
                    assert reply.status_code == 200, reply.text
                    text = engine.front.tokenizer.decode(want[0], skip_special_tokens=True)
                    assert reply.json()["choices"][0]["text"] == text
                metrics = client.get("/metrics").text
                assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters=""' in metrics
                missing = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
                assert missing.status_code == 404
                assert missing.json()["error"]["message"] == "the model `nope` does not exist"
                off = client.post(
                    "/v1/load_lora_adapter",
                    json={"lora_name": "late", "lora_path": str(adapters["all-r64-rs"])},
                )
                assert off.status_code == 400
                assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in off.json()["error"]["message"]
        modules = {name: str(adapters[name])}
        with running_app(engine, lora_modules=modules, runtime_lora_updates=True) as url:
            with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
                late = {"lora_name": "late", "lora_path": str(adapters["all-r64-rs"])}
                assert client.post("/v1/load_lora_adapter", json=late).status_code == 200
                again = client.post("/v1/load_lora_adapter", json=late)
                assert again.status_code == 400 and "already" in again.text
                models = [m["id"] for m in client.get("/v1/models").json()["data"]]
                assert models == ["tiny", name, "late"]
                body = {
                    "model": "late", "prompt": prompts[1], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True,
                }  # fmt: skip
                text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
                want = expected["all-r64-rs"][1]
                assert text == engine.front.tokenizer.decode(want, skip_special_tokens=True)
                gone = {"lora_name": "late"}
                assert client.post("/v1/unload_lora_adapter", json=gone).status_code == 200
                assert client.post("/v1/completions", json=body).status_code == 404
                assert client.post("/v1/unload_lora_adapter", json=gone).status_code == 404
                broken = {"lora_name": "bad", "lora_path": str(url)}
                refused = client.post("/v1/load_lora_adapter", json=broken)
                assert refused.status_code == 400 and "adapter_config.json" in refused.text
    finally:
        engine.shutdown()


def test_the_engine_counts_each_adapters_requests(lora_llm):
    engine = lora_llm.engine
    for index in range(3):
        engine.add_request([5, 6, 7 + index], GREEDY, lora_request="attn-r4")
    engine.add_request([5, 6, 9], GREEDY)
    engine.step()  # takes them in and runs their prompts
    stats = engine.stats()
    assert stats.running_loras == {"attn-r4": 3} and stats.waiting_loras == {}
    assert stats.max_loras == len(engine.lora.served)
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    assert engine.stats().running_loras == {} and engine.pool.allocator.num_used == 0


def test_at_most_max_cpu_loras_adapters_stay_in_memory(tiny_llama_dir, adapters, peft_outputs):
    """--max-cpu-loras 1 over three adapters: one in memory at a time, the others read again
    from their folders when asked for (their load generation, and so their cached prefixes,
    kept), each still giving PEFT's texts."""
    prompts, expected = peft_outputs
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    llm = _lora_llm(tiny_llama_dir, max_cpu_loras=1, lora_modules=modules)
    try:
        registry = llm.engine.lora
        assert registry.num_resident == 1 and len(registry.served) == 3
        for _ in range(2):
            for name in adapters:
                got = llm.generate(
                    prompts[:1], GREEDY, use_tqdm=False, lora_request=_named(name, adapters)
                )
                assert got[0].token_ids == expected[name][0], name
                assert registry.num_resident == 1
        assert {s.generation for s in registry.served.values()} == {0}
    finally:
        llm.close()
