"""--generation-config: a request that leaves a sampling setting out gets the model creator's
(its generation_config.json), as vLLM's `auto`; `vllm` keeps ours."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from bulletserve.engine.client import ModelFront
from bulletserve.engine.config import EngineConfig
from tests.server.harness import running_app, tiny_engine


def test_auto_reads_the_model_folders_generation_config(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    settings = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7}
    (model / "generation_config.json").write_text(json.dumps(settings | {"do_sample": True}))
    front = ModelFront.load(EngineConfig(model=str(model)))
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert front.sampling_defaults.values == expected
    ours = ModelFront.load(EngineConfig(model=str(model), generation_config="vllm"))
    assert ours.sampling_defaults.values == {}
    # The folder without the file: ours.
    (model / "generation_config.json").unlink()
    assert ModelFront.load(EngineConfig(model=str(model))).sampling_defaults.values == {}


def test_a_request_keeps_what_it_sets_and_gets_the_models_defaults_for_the_rest(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    engine = tiny_engine(generation_config=str(tmp_path))
    body = {"model": "tiny", "prompt": "Hello there", "temperature": 0, "ignore_eos": True}
    try:
        with running_app(engine) as url:
            default = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            assert default["usage"]["completion_tokens"] == 3
            given = httpx.post(
                f"{url}/v1/completions", json=body | {"max_tokens": 5}, timeout=60
            ).json()
            assert given["usage"]["completion_tokens"] == 5
    finally:
        engine.shutdown()


def test_a_folder_without_a_generation_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--generation-config"):
        EngineConfig(model="tiny", load_format="dummy", generation_config=str(tmp_path))


def test_the_offline_api_defaults_to_the_models_generation_config(tmp_path):
    from bulletserve import LLM
    from tests.server.harness import need_tokenizer

    need_tokenizer()
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    llm = LLM("tiny", load_format="dummy", generation_config=str(tmp_path))
    try:
        assert llm.get_default_sampling_params().max_tokens == 4
        (output,) = llm.generate("Hello", use_tqdm=False)
        assert len(output.outputs[0].token_ids) <= 4
    finally:
        llm.close()
