"""Ours against vLLM's CPU build and llama.cpp's server on this machine, side by side, driven by
vLLM's own client.

For each repeat, each configuration in turn (interleaved): start its server, run vLLM's
benchmark client (`../shared/peers/vllm_bench_serve.py`, random dataset, greedy, ignore_eos)
at each Poisson rate and each concurrency level, stop it. Reports per configuration the medians
over repeats of: SLO attainment per rate (a request counts if TTFT <= --slo-ttft-per-token-ms x
its prompt tokens and its TPOT <= --slo-tpot-ms), the highest rate at 90% attainment, output
throughput at saturation (the highest rate), mean TPOT at each concurrency (over
max(4, concurrency) requests), and the server's peak RSS (its whole process tree). Set up the
peers first (`../shared/peers/README.md`).

    .venv/bin/python scripts/compare_vllm_cpu.py --configs vllm,chunked,bullet \
        --input-len 384 --output-len 96 --rates 4,6,8,11 --concurrency 1,16,64 --repeats 3 \
        --slo-ttft-per-token-ms 4 --slo-tpot-ms 250 --output compare.json

Quantized weights: `llama` is llama.cpp's `llama-server` on `--gguf` (continuous batching over as
many slots as the highest concurrency), and ours serve that file too when `--gguf` is given; a
config's `@Q` suffix passes `--quantization Q` to ours (`chunked@none`: the file dequantized).

    .venv/bin/python scripts/compare_vllm_cpu.py --configs llama,chunked,chunked@none \
        --gguf FILE.gguf --input-len 256 --output-len 64 --rates 2,4 --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from bulletserve.bench.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"
VLLM_PYTHON = "/tmp/vllm-cpu/bin/python"
PEER_MODEL = "/tmp/smollm2-hf"  # what serve_vllm_cpu.sh serves, and the client's tokenizer
LLAMA_SERVER = "/tmp/llama-cpp/bin/llama-server"  # ../shared/peers/setup_llama_cpp.sh
LLAMA_SLOT_CONTEXT = 1024  # tokens a llama-server slot holds


def server_command(
    config: str, port: int, extra: list[str], peer_dtype: str, gguf: str | None, slots: int
) -> tuple[list[str], str]:
    """(the command that serves `config` on `port`, the model name it reports). `vllm` is the
    peer as serve_vllm_cpu.sh starts it, in `peer_dtype`; `vllm-N` the same with
    --max-num-batched-tokens N (its chunk), `chunked-N` ours with --chunked-prefill-size N;
    `llama` llama-server on `gguf` with `slots` slots; `...@Q` ours with --quantization Q."""
    config, _, quantization = config.partition("@")
    policy, _, chunk = config.partition("-")
    if policy == "llama":
        if gguf is None:
            sys.exit("the llama config serves a GGUF file: give --gguf")
        command = [LLAMA_SERVER, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
        command += ["-t", str(os.cpu_count()), "--parallel", str(slots), "--cont-batching"]
        command += ["-c", str(slots * LLAMA_SLOT_CONTEXT), "--alias", "llama"]
        return command, "llama"
    if policy == "vllm":
        command = [str(PEERS / "serve_vllm_cpu.sh"), str(port)]
        if chunk or peer_dtype != "bfloat16":
            # serve_vllm_cpu.sh takes no extra flags: its command with these
            env = "VLLM_CACHE_ROOT=/tmp/vllm-cache VLLM_CPU_KVCACHE_SPACE=2 "
            env += "VLLM_CPU_OMP_THREADS_BIND=0-1 HF_HUB_OFFLINE=1 VLLM_HTTP_TIMEOUT_KEEP_ALIVE=120"
            command = ["env", *env.split(), VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"]
            command += ["--model", PEER_MODEL, "--dtype", peer_dtype, "--max-model-len", "4096"]
            command += ["--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching"]
            if chunk:
                command += ["--max-num-batched-tokens", chunk]
        return command, PEER_MODEL
    # Prefix caching off as the peer runs it: the client repeats its seeded prompts at every
    # rate, which a cache would turn into hits after the first.
    command = [str(ROOT / ".venv" / "bin" / "bullet"), "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--policy", policy, "--no-enable-prefix-caching", *extra]
    if chunk:
        command += ["--chunked-prefill-size", chunk]
    if quantization:
        command += ["--quantization", quantization]
    if gguf is not None:
        command += ["--model", gguf, "--served-model-name", "ours"]
        return command, "ours"
    return command, "SmolLM2-135M-Instruct"


class Server:
    """A server process (`ServerProcess`) and its process tree's peak RSS."""

    def __init__(self, command: list[str], port: int, log: Path) -> None:
        self.process = ServerProcess(command, port, log)
        self.wait_ready = self.process.wait_ready
        self.peak_rss = 0
        self._sampling = True
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        root = psutil.Process(self.process.process.pid)
        while self._sampling:
            try:
                tree = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree if p.is_running())
                self.peak_rss = max(self.peak_rss, rss)
            except psutil.Error:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        self._sampling = False
        self.process.stop()


def run_client(
    args: argparse.Namespace, port: int, name: str, load: list[str], out: Path, prompts: int
) -> dict:
    command = [VLLM_PYTHON, str(PEERS / "vllm_bench_serve.py"), "--backend", "openai"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--endpoint", "/v1/completions"]
    command += ["--model", PEER_MODEL, "--served-model-name", name]
    command += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    command += ["--random-output-len", str(args.output_len)]
    command += ["--random-range-ratio", str(args.range_ratio), "--num-prompts"]
    command += [str(prompts), "--temperature", "0", "--ignore-eos", "--seed"]
    command += [str(args.seed), *load, "--save-result", "--save-detailed"]
    command += ["--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=3600)
    return json.loads(out.read_text())


def score(result: dict, args: argparse.Namespace, prompts: int) -> dict:
    """Attainment, throughput and mean TPOT of one client run."""
    met, tpots = 0, []
    rows = zip(
        result["input_lens"], result["output_lens"], result["ttfts"], result["latencies"],
        strict=True,
    )  # fmt: skip
    for prompt, output, ttft, latency in rows:
        if not ttft or output < 1:
            continue
        tpot = (latency - ttft) / (output - 1) if output > 1 else 0.0
        tpots.append(tpot)
        if ttft <= args.slo_ttft_per_token_ms * 1e-3 * prompt and tpot <= args.slo_tpot_ms * 1e-3:
            met += 1
    return {
        "attainment": met / prompts,
        "output_tok_s": result["output_throughput"],
        "mean_tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
        "mean_ttft_ms": result["mean_ttft_ms"],
        "failed": result["failed"],
    }


def capacity(attainment: dict[float, float], target: float = 0.9) -> float | None:
    """The rate where attainment falls through `target`: linearly interpolated between the last
    rate at or above it (every lower rate too) and the next one; that last rate if no rate
    falls below; None if the lowest rate is already below."""
    rates = sorted(attainment)
    best = None
    for low, high in zip(rates, [*rates[1:], None], strict=True):
        if attainment[low] < target:
            break
        best = low
        if high is not None and attainment[high] < target:
            fall = (attainment[low] - target) / (attainment[low] - attainment[high])
            return low + fall * (high - low)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="vllm,chunked,bullet")
    parser.add_argument("--input-len", type=int, default=384)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--range-ratio", type=float, default=0.6)
    parser.add_argument("--num-prompts", type=int, default=150)
    parser.add_argument("--rates", default="4,6,8,11")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--slo-ttft-per-token-ms", type=float, default=4.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0)
    parser.add_argument("--port", type=int, default=18950)
    parser.add_argument("--ours-args", default="", help="extra flags for `bullet serve`")
    parser.add_argument(
        "--peer-dtype",
        default="bfloat16",
        help="vLLM's --dtype: float32 on a CPU without native bf16, where its bf16 is slow",
    )
    parser.add_argument(
        "--gguf", default=None, help="a GGUF file llama-server and ours serve (the llama config)"
    )
    parser.add_argument("--output", default="compare_vllm_cpu.json")
    args = parser.parse_args()
    if not Path(VLLM_PYTHON).exists():
        sys.exit("vLLM's CPU build is not set up: bash ../shared/peers/setup_vllm_cpu.sh")

    rates = [float(r) for r in args.rates.split(",") if r]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    work = Path(tempfile.mkdtemp(prefix="compare-vllm-"))
    for repeat in range(args.repeats):
        for config in configs:
            command, name = server_command(
                config, args.port, args.ours_args.split(), args.peer_dtype, args.gguf, max(levels)
            )
            server = Server(command, args.port, work / f"{config}-{repeat}.log")
            run: dict = {"rates": {}, "concurrency": {}}
            try:
                server.wait_ready()
                for rate in rates:
                    out = work / f"{config}-{repeat}-r{rate}.json"
                    load = ["--request-rate", str(rate)]
                    result = run_client(args, args.port, name, load, out, args.num_prompts)
                    run["rates"][rate] = score(result, args, args.num_prompts)
                for level in levels:
                    out = work / f"{config}-{repeat}-c{level}.json"
                    load = ["--request-rate", "inf", "--max-concurrency", str(level)]
                    # `level` streams at once (four in turn for one stream)
                    prompts = max(4, level)
                    result = run_client(args, args.port, name, load, out, prompts)
                    run["concurrency"][level] = score(result, args, prompts)
            finally:
                server.stop()
            run["peak_rss_mb"] = server.peak_rss / 2**20
            runs[config].append(run)
            print(f"[{repeat}] {config}: {json.dumps(run)}", flush=True)

    summary = {}
    for config, config_runs in runs.items():
        attain = {
            r: statistics.median(x["rates"][r]["attainment"] for x in config_runs) for r in rates
        }
        top = max(rates)
        summary[config] = {
            "attainment": attain,
            "capacity_at_90": capacity(attain),
            "output_tok_s_at_highest_rate": statistics.median(
                x["rates"][top]["output_tok_s"] for x in config_runs
            ),
            "mean_tpot_ms_at_concurrency": {
                c: _median_measured(x["concurrency"][c]["mean_tpot_ms"] for x in config_runs)
                for c in levels
            },
            "output_tok_s_at_concurrency": {
                c: statistics.median(x["concurrency"][c]["output_tok_s"] for x in config_runs)
                for c in levels
            },
            "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in config_runs),
        }
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "summary": summary,
        "runs": runs,
    }
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


def _median_measured(values: Iterable[float | None]) -> float | None:
    """The median of the rounds that measured something (a round whose requests all failed has
    no TPOT), or None if none did."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
