"""Server overhead: output tokens/s through `bullet serve` vs the offline `LLM.generate` API.

Both sides get the same requests (fixed random prompt token ids, greedy, ignore_eos, a fixed
output length) and the same engine settings, with at most `--concurrency` requests in flight:
the server is driven by that many streaming clients, the offline engine runs with
`max_num_seqs = concurrency`. The server runs in a subprocess, the client and the offline engine
in this process; runs alternate (offline, server, offline, ...) and the medians are reported.

    .venv/bin/python benchmarks/bench_server_overhead.py --runs 3 --output result.json

Cited in docs/benchmarks.md "Server overhead" and docs/benchmarks-server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bulletserve.bench.server_process import ServerProcess


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as for bullet serve (default: SmolLM2)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    return parser.parse_args()


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    return [
        [rng.randrange(1000, vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--load-format", args.load_format, "--dtype", args.dtype, "--seed", str(args.seed)]
    flags += ["--max-num-seqs", str(args.concurrency)]
    return flags + (["--model", args.model] if args.model else [])


def start_server(args: argparse.Namespace, log_path: Path) -> ServerProcess:
    command = [
        sys.executable, "-c", "import sys; from bulletserve.cli import main; sys.exit(main())",
        "serve", "--host", "127.0.0.1", "--port", str(args.port), "--log-level", "warning",
        *engine_flags(args),
    ]  # fmt: skip
    server = ServerProcess(command, args.port, log_path)
    server.wait_ready(300, poll_s=0.5)
    return server


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int) -> int:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # The client shares the CPU with the server: keep only the tail of the stream (the last
    # event before [DONE] carries the usage) instead of decoding every event.
    tail = b""
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for data in response.aiter_raw():
            tail = (tail + data)[-4096:]
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    return json.loads(events[-1][6:])["usage"]["completion_tokens"]


@dataclass
class Run:
    tokens: int
    wall_s: float
    cpu_s: float  # CPU time of every process involved (server and client, or the offline engine)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tok_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process, or of process `pid` (all its threads)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _through_server(url: str, prompts: list[list[int]], args: argparse.Namespace) -> int:
    queue = list(reversed(prompts))
    tokens = 0
    limits = httpx.Limits(max_connections=args.concurrency, keepalive_expiry=30)
    async with httpx.AsyncClient(limits=limits, timeout=600, trust_env=False) as client:

        async def worker() -> None:
            nonlocal tokens
            while queue:
                produced = await _one(client, url, queue.pop(), args.output_len)
                tokens += produced

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return tokens


def server_run(url: str, pid: int, prompts: list[list[int]], args: argparse.Namespace) -> Run:
    cpu, start = cpu_seconds() + cpu_seconds(pid), time.perf_counter()
    tokens = asyncio.run(_through_server(url, prompts, args))
    wall = time.perf_counter() - start
    assert tokens == len(prompts) * args.output_len, tokens
    return Run(tokens, wall, cpu_seconds() + cpu_seconds(pid) - cpu)


def offline_run(llm, prompts: list[list[int]], args: argparse.Namespace) -> Run:
    from bulletserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    cpu, start = cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == len(prompts) * args.output_len, tokens
    return Run(tokens, wall, cpu_seconds() - cpu)


def main() -> None:
    args = parse_args()
    from bulletserve.engine.llm import LLM

    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        seed=args.seed,
        max_num_seqs=args.concurrency,
    )
    prompts = make_prompts(args, llm.engine.model_config.vocab_size)
    warmup = prompts[: args.concurrency // 4 or 1]
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args, Path(tmp) / "serve.log")
        url = f"http://127.0.0.1:{args.port}"
        try:
            offline_run(llm, warmup, args)
            server_run(url, server.process.pid, warmup, args)
            offline, served, load = [], [], []
            for run in range(args.runs):
                load.append(os.getloadavg()[0])  # other work on the machine skews a run
                offline.append(offline_run(llm, prompts, args))
                served.append(server_run(url, server.process.pid, prompts, args))
                print(
                    f"run {run + 1}: offline {offline[-1].tok_s:.1f} tok/s "
                    f"({offline[-1].tok_per_cpu_s:.1f} tok/CPU-s), server "
                    f"{served[-1].tok_s:.1f} tok/s ({served[-1].tok_per_cpu_s:.1f} tok/CPU-s), "
                    f"ratio {served[-1].tok_s / offline[-1].tok_s:.3f}; "
                    f"load average before the run {load[-1]:.2f}",
                    flush=True,
                )
        finally:
            server.stop()

    def median_ratio(metric: str) -> float:
        ratios = [
            getattr(s, metric) / getattr(o, metric) for s, o in zip(served, offline, strict=True)
        ]
        return statistics.median(ratios)

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "offline": [asdict(r) | {"tok_s": r.tok_s} for r in offline],
        "server": [asdict(r) | {"tok_s": r.tok_s} for r in served],
        "load_average_1min": load,
        "median_offline_tok_s": statistics.median(r.tok_s for r in offline),
        "median_server_tok_s": statistics.median(r.tok_s for r in served),
        "median_ratio_tok_s": median_ratio("tok_s"),
        "median_ratio_tok_per_cpu_s": median_ratio("tok_per_cpu_s"),
    }
    print(
        f"median: offline {result['median_offline_tok_s']:.1f} tok/s, server "
        f"{result['median_server_tok_s']:.1f} tok/s; server/offline: throughput "
        f"{result['median_ratio_tok_s']:.3f}, tokens per CPU-second "
        f"{result['median_ratio_tok_per_cpu_s']:.3f}"
    )
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
