"""Prefix caching through the server: a workload with shared prefixes (`shared-prefix` or
`multi-turn`) with the cache on and off, ours and vLLM's CPU build side by side.

Every configuration's server is started first (vLLM's as ../shared/peers/serve_vllm_cpu.sh
starts it, with its prefix caching on or off); then, for each repeat and each rate, every
configuration in turn (the order rotating), `bullet bench` sends the workload with a seed of
its own for that (repeat, rate): new system prompts and questions, so that a run finds in the
cache only what its own requests computed. Each server's prefix-cache counters
(`vllm:prefix_cache_queries_total` / `_hits_total`, which ours exports too) are read before and
after a run. Reports per configuration and rate the medians over repeats of mean and P90 TTFT,
output tokens/s, hit rate and SLO attainment, and the highest rate at 90% attainment.

    .venv/bin/python benchmarks/bench_prefix_cache.py --configs chunked,chunked-no-cache,vllm,\\
        vllm-no-cache --rates 2,4,6 --repeats 3 --num-prompts 100 \\
        --slo-ttft-per-token-ms 4 --slo-tpot-ms 250 --out /tmp/prefix-cache

Cited in docs/benchmarks.md "Prefix caching".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

from bulletserve.bench.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"
VLLM_PYTHON = "/tmp/vllm-cpu/bin/python"
PEER_MODEL = "/tmp/smollm2-hf"
VLLM_ENV = {
    "VLLM_CACHE_ROOT": "/tmp/vllm-cache",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "120",
}


def server_command(config: str, port: int, max_model_len: int) -> tuple[list[str], dict]:
    """(command, extra environment) of a configuration: `vllm[-no-cache]` is the peer,
    `POLICY[-no-cache]` ours under that policy, with as much KV memory as the peer's (with the
    cache on, a pool fills up with cached blocks over time: several servers side by side at
    their default of 0.3 of free memory each would not fit in this machine's memory)."""
    name, cached = config.removesuffix("-no-cache"), not config.endswith("-no-cache")
    caching = "--enable-prefix-caching" if cached else "--no-enable-prefix-caching"
    if name == "vllm":
        command = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", PEER_MODEL, "--dtype", "bfloat16"]
        command += ["--max-model-len", str(max_model_len), "--host", "127.0.0.1"]
        return [*command, "--port", str(port), caching], VLLM_ENV
    command = [sys.executable, "-m", "bulletserve.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--policy", name, "--max-model-len", str(max_model_len)]
    command += ["--kv-cache-memory", f"{VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']}GiB"]
    return [*command, "--log-level", "warning", caching], {}


class Server:
    """One configuration's server (`ServerProcess`) and its prefix-cache counters."""

    def __init__(self, config: str, args: argparse.Namespace) -> None:
        self.config = config
        self.port = free_port()
        command, env = server_command(config, self.port, args.max_model_len)
        log = args.out / f"{config}.serve.log"
        self.process = ServerProcess(command, self.port, log, env)
        self.wait_ready = self.process.wait_ready
        self.stop = self.process.stop

    def cache_counters(self) -> tuple[float, float]:
        """(prefix-cache queries, hits) so far, in tokens."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        totals = {"queries": 0.0, "hits": 0.0}
        for line in text.splitlines():
            for kind in totals:
                if line.startswith(f"vllm:prefix_cache_{kind}_total"):
                    totals[kind] += float(line.rsplit(" ", 1)[1])
        return totals["queries"], totals["hits"]


def bench(server: Server, rate: str, seed: int, out: Path, args: argparse.Namespace) -> None:
    """One `bullet bench` run, its result (with the run's prefix-cache hit rate in its
    summary) saved to `out`."""
    command = [sys.executable, "-m", "bulletserve.cli", "bench"]
    command += ["--base-url", f"http://127.0.0.1:{server.port}"]
    command += ["--dataset", args.dataset, "--num-prompts", str(args.num_prompts)]
    command += ["--max-model-len", str(args.max_model_len), "--seed", str(seed)]
    command += ["--request-rate", rate, "--ignore-eos", "--no-progress", "--output", str(out)]
    command += ["--slo-ttft-per-token-ms", str(args.slo_ttft_per_token_ms)]
    command += ["--slo-tpot-ms", str(args.slo_tpot_ms), "--label", server.config]
    if server.config.startswith("vllm"):
        command += ["--model", PEER_MODEL]
    queries, hits = server.cache_counters()
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{server.config} at {rate}: bench failed:\n{result.stderr[-2000:]}")
    after_queries, after_hits = server.cache_counters()
    saved = json.loads(out.read_text())
    asked = after_queries - queries
    saved["runs"][0]["summary"]["prefix_cache_hit_rate"] = (
        (after_hits - hits) / asked if asked else 0.0
    )
    out.write_text(json.dumps(saved))


def report(out: Path, configs: list[str]) -> None:
    """Medians per configuration and rate over every run saved in `out` (by this invocation
    or an earlier one), and each configuration's highest rate at 90% attainment."""
    runs: dict[tuple[str, float], list[dict]] = {}
    for path in out.glob("*.rate-*.seed-*.json"):
        config, rest = path.name.split(".rate-", 1)
        if config in configs:
            rate = float(rest.split(".seed-", 1)[0])
            runs.setdefault((config, rate), []).append(
                json.loads(path.read_text())["runs"][0]["summary"]
            )
    print("| config | rate | runs | mean TTFT ms | P90 TTFT ms | output tok/s | hit rate | SLO |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    table = []
    for config, rate in sorted(runs, key=lambda key: (configs.index(key[0]), key[1])):
        summaries = runs[config, rate]
        row = {
            "config": config,
            "rate": rate,
            "runs": len(summaries),
            "mean_ttft_ms": statistics.median(s["ttft_ms"]["mean"] for s in summaries),
            "p90_ttft_ms": statistics.median(s["ttft_ms"]["p90"] for s in summaries),
            "output_tok_s": statistics.median(s["output_throughput"] for s in summaries),
            # (runs saved by an earlier version of this script have no hit rate)
            "hit_rate": statistics.median(
                s["prefix_cache_hit_rate"] for s in summaries if "prefix_cache_hit_rate" in s
            ),
            "attainment": statistics.median(s["slo"]["attainment"] for s in summaries),
        }
        table.append(row)
        print(
            f"| {config} | {rate:g} | {len(summaries)} | {row['mean_ttft_ms']:.0f} | "
            f"{row['p90_ttft_ms']:.0f} | {row['output_tok_s']:.1f} | {row['hit_rate']:.2f} | "
            f"{row['attainment']:.2f} |"
        )
    for config in configs:
        held = [r["rate"] for r in table if r["config"] == config and r["attainment"] >= 0.9]
        print(f"{config}: highest rate at 90% attainment: {max(held) if held else 'none'} req/s")
    (out / "summary.json").write_text(json.dumps(table, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default="chunked,chunked-no-cache,vllm,vllm-no-cache")
    parser.add_argument(
        "--dataset", default="shared-prefix", choices=("shared-prefix", "multi-turn")
    )
    parser.add_argument("--rates", default="2,4,6")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--seed", type=int, default=0, help="run k of rate index i uses seed + 1000 k + i"
    )
    parser.add_argument("--slo-ttft-per-token-ms", type=float, default=4.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    configs = args.configs.split(",")
    rates = args.rates.split(",")
    if any(c.startswith("vllm") for c in configs) and not Path(VLLM_PYTHON).exists():
        sys.exit(f"no vLLM peer at {VLLM_PYTHON}: run {PEERS / 'setup_vllm_cpu.sh'} first")
    servers = [Server(config, args) for config in configs]
    try:
        for server in servers:
            server.wait_ready()
        for repeat in range(args.repeats):
            for index, rate in enumerate(rates):
                seed = args.seed + 1000 * repeat + index
                turn = (index + repeat) % len(servers)
                for server in servers[turn:] + servers[:turn]:
                    out = args.out / f"{server.config}.rate-{rate}.seed-{seed}.json"
                    bench(server, rate, seed, out, args)
                    print(f"{server.config} at {rate} req/s, seed {seed} done", flush=True)
    finally:
        for server in servers:
            server.stop()
    report(args.out, configs)


if __name__ == "__main__":
    main()
