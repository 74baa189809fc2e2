"""The flags a vLLM user types: each does what vLLM's does here, or is refused naming why."""

from __future__ import annotations

import logging

import httpx
import pytest

from bulletserve.cli import build_parser, main
from bulletserve.engine.config import EngineConfig
from tests.server.harness import need_tokenizer, running_app, tiny_engine

TINY = ["serve", "--model", "tiny", "--load-format", "dummy", "--port", "0"]


def _engine_config(*flags: str) -> EngineConfig:
    return EngineConfig.from_args(build_parser().parse_args([*TINY, *flags]))


def test_help_ends_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (
        "--max-num-seqs MAX_NUM_SEQS (default: 256)",
        "--policy {chunked,prefill-first,bullet} (default: chunked)",
        "--port PORT (default: 8000)",
        "--slo-tpot-ms SLO_TPOT_MS (default: 150.0)",
        "--generation-config GENERATION_CONFIG",
    ):
        assert shown in text, shown
    assert "(default: $BULLET_API_KEY)" in text  # the key itself never appears in --help


def test_enable_chunked_prefill_picks_the_policy_as_vllms_does():
    assert _engine_config().policy == "chunked"
    assert _engine_config("--enable-chunked-prefill").policy == "chunked"
    assert _engine_config("--no-enable-chunked-prefill").policy == "prefill-first"
    assert _engine_config("--policy", "bullet", "--enable-chunked-prefill").policy == "bullet"
    with pytest.raises(ValueError, match="bullet policy rides long prompts in chunks"):
        _engine_config("--policy", "bullet", "--no-enable-chunked-prefill")


def test_gpu_memory_utilization_on_a_cpu_names_the_flag_that_sizes_its_kv_cache(capsys):
    need_tokenizer()
    argv = [*TINY, "--device", "cpu", "--gpu-memory-utilization", "0.9"]
    assert main(argv) == 2
    assert "on a CPU, --kv-cache-memory does" in capsys.readouterr().err


def test_enable_log_requests_logs_each_request_and_its_end(caplog):
    engine = tiny_engine()
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    try:
        with caplog.at_level(logging.INFO, logger="bulletserve.server.serving"):
            with running_app(engine, log_requests=True) as url:
                reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert reply.status_code == 200
            with running_app(engine) as url:  # off by default
                httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    finally:
        engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "bulletserve.server.serving"]
    assert len(lines) == 2, lines
    assert "prompt tokens, max_tokens=3, temperature=0" in lines[0]
    assert lines[1].endswith("length after 3 tokens")
    assert "Hello" not in " ".join(lines)  # ids and counts, never the prompt's text
