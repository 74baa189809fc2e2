"""The flags a vLLM user types: each does what vLLM's does here, or is refused naming why."""

from __future__ import annotations

import logging
import subprocess
import sys

import httpx
import pytest

from bulletserve.cli import build_parser, main
from bulletserve.cli.serve import engine_core
from bulletserve.engine.config import EngineConfig, waits_for_handoff
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


def test_the_command_line_builds_without_torch():
    """`bullet --help` and every subcommand's parser stay light: torch, transformers and
    matplotlib load only when a command runs."""
    code = (
        "import sys; from bulletserve.cli import build_parser; build_parser(); "
        "print(sorted({'torch', 'transformers', 'matplotlib', 'fastapi'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["simulate", "capacity", "--help"], "--workloads WORKLOADS"),
        (["simulate", "fidelity", "--help"], "--served-speed"),
        (["simulate", "paper", "--help"], "--out OUT"),
        (["profile", "validate", "--help"], "--repeats REPEATS"),
    ],
)
def test_the_studies_are_subcommands(capsys, argv, shown):
    with pytest.raises(SystemExit):
        main(argv)
    assert shown in capsys.readouterr().out


def test_simulate_without_a_device_names_the_flags(capsys):
    assert main(["simulate", "--policy", "chunked"]) == 2
    assert "--hardware and --model are required" in capsys.readouterr().err


def test_every_flag_defaults_to_its_configs_default():
    """Each default is stated once, in EngineConfig: no flags give the config's defaults."""
    assert _engine_config() == EngineConfig(model="tiny", load_format="dummy")


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


def test_the_engine_core_runs_in_a_process_on_a_gpu_and_never_beside_replicas(capsys):
    assert engine_core("auto", "cpu") == "thread"  # the compute takes the CPU's cores
    assert engine_core("process", "cpu") == "process"
    argv = [*TINY, "--engine-core", "process", "-dp", "2", "--distributed-executor-backend", "ray"]
    assert main(argv) == 2
    assert "--engine-core: each data-parallel replica is a Ray actor's process" in (
        capsys.readouterr().err
    )


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


def test_the_startup_block_says_what_runs():
    engine = tiny_engine(policy="bullet", slo_tpot_ms=200.0)
    try:
        lines = engine.describe()
    finally:
        engine.shutdown()
    text = "\n".join(lines)
    assert lines[0] == "model: dummy-tiny (dummy)"
    assert "device: CPU, " in text and "max model length: " in text
    kv = next(line for line in lines if line.startswith("KV cache: "))
    assert " tokens in " in kv and "blocks of 16" in kv and kv.endswith("prefix caching on")
    assert (
        "policy: bullet (partition auto; SLO TTFT 3 ms a prompt token + 0 ms, TPOT 200 ms" in text
    )
    assert "profile measured at start" in text
    assert lines[-4].startswith("kernels: projections ")
    assert lines[-3] == "speculative decoding: off"
    assert lines[-2] == "LoRA adapters: off"
    # On a CPU the engine waits for the event loop's hand-off; on a GPU it would step on.
    assert lines[-1].startswith("engine: a thread of the server process; it waits for the ")
    assert engine.engine.life.acks_handoff
    assert waits_for_handoff("cpu") and not waits_for_handoff("cuda")


def test_the_startup_block_says_when_steps_overlap():
    engine = tiny_engine(policy="chunked", async_scheduling=True)
    try:
        policy = next(line for line in engine.describe() if line.startswith("policy: "))
    finally:
        engine.shutdown()
    assert "planned and launched while the last runs (--async-scheduling)" in policy
    assert "on a CPU overlaps nothing" in policy


def test_the_stats_line_reports_an_interval_and_stays_quiet_while_idle():
    from bulletserve.engine.client import EngineStats
    from bulletserve.server.stats_log import StatsLog

    log = StatsLog(engine=None)  # type: ignore[arg-type]  # line() reads only what it is given
    assert log.line(EngineStats(), 10.0) is None  # idle from the start: nothing
    busy = EngineStats(
        num_running=2,
        num_waiting=1,
        kv_blocks_used=25,
        kv_blocks_total=100,
        prefix_cache_queries=400,
        prefix_cache_hits=100,
        prompt_tokens=400,
        generation_tokens=50,
    )
    assert log.line(busy, 20.0) == (
        "prompt throughput: 40.0 tokens/s, generation throughput: 5.0 tokens/s, running: 2 "
        "reqs, waiting: 1 reqs, KV cache usage: 25.0%, prefix cache hit rate: 25.0%"
    )
    idle = EngineStats(kv_blocks_total=100, prompt_tokens=400, generation_tokens=50)
    assert log.line(idle, 30.0) is not None  # the interval it fell idle in is reported
    assert log.line(idle, 40.0) is None
