"""The lanes issue's CPU benchmark: bullet vs chunked (two chunk sizes), prefill-first and the
partition ablations, through the real server with `bullet bench`.

1. Isolated latencies: a dozen `sharegpt-like` requests one at a time through the offline API
   (chunked policy, whole device). TTFT has a fixed part and a per-token part: a least-squares
   line TTFT = a + b * input tokens through the isolated requests gives both, and the TTFT SLO
   is SLO_FACTOR times that line (`--slo-ttft-base-ms` 5a, `--slo-ttft-per-token-ms` 5b), so
   every prompt, short or long, gets about SLO_FACTOR times its isolated TTFT. (`--slo-mode
   per-token`: the paper's per-token SLO alone, at SLO_FACTOR times the P90 per-token TTFT; a
   prompt of a few tokens then gets less than twice its isolated TTFT.) TPOT: SLO_FACTOR times
   the median.
2. For each configuration: start `bullet serve` (default model, `--dtype auto`: bf16 where
   the CPU has it, else fp32; --step-log), sweep the request rates with `bullet bench`, stop
   the server. `--interleave`: start every
   configuration's server first, then run each rate against every configuration in turn (the
   machine's slow spells then fall on all configurations of a rate alike).
3. Plots and a comparison table.

    python benchmarks/bench_lanes_cpu.py --out docs/data/bench-cpu --rates 0.5,1,1.5,2,3

Cited in docs/benchmarks.md "Bullet on the CPU".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bulletserve.bench.server_process import ServerProcess, free_port

SLO_FACTOR = 5.0
CONFIGS = {
    "bullet": ["--policy", "bullet"],
    "bullet-no-fuse": ["--policy", "bullet", "--no-fuse-decode"],
    "chunked-128": ["--policy", "chunked", "--chunked-prefill-size", "128"],
    "chunked-512": ["--policy", "chunked", "--chunked-prefill-size", "512"],
    "prefill-first": ["--policy", "prefill-first"],
    "bullet-partition-none": ["--policy", "bullet", "--partition", "none"],
    "bullet-static-1-1": ["--policy", "bullet", "--partition", "static:1/1"],
}


def isolated_latencies(max_model_len: int, count: int, seed: int) -> dict:
    import numpy as np

    from bulletserve import LLM, SamplingParams
    from bulletserve.bench.lengths import fit_to_context, sample_sharegpt_like

    llm = LLM(max_model_len=max_model_len)
    pairs = fit_to_context(sample_sharegpt_like(count, np.random.default_rng(seed)), max_model_len)
    ttft_per_token, tpot = [], []
    for index, (n_in, n_out) in enumerate(pairs):
        prompt = [100 + (index * 31 + k * 7) % 40000 for k in range(n_in)]
        out = llm.generate([prompt], SamplingParams(max_tokens=max(n_out, 2), ignore_eos=True))[0]
        t = out.timings
        ttft_per_token.append((t.first_token - t.arrival) / n_in)
        tpot.append((t.finished - t.first_token) / (len(out.token_ids) - 1))
    return {
        "requests": pairs,
        "ttft_per_token_ms_all": [t * 1e3 for t in ttft_per_token],
        "ttft_per_token_ms": float(np.percentile(ttft_per_token, 90)) * 1e3,
        "tpot_ms": statistics.median(tpot) * 1e3,
    }


def slos(iso: dict, mode: str) -> dict[str, float]:
    """SLO_FACTOR times the isolated latencies (see the module docstring)."""
    import numpy as np

    tpot = SLO_FACTOR * iso["tpot_ms"]
    if mode == "per-token":
        return {"ttft_base": 0.0, "ttft": SLO_FACTOR * iso["ttft_per_token_ms"], "tpot": tpot}
    lens = np.array([n for n, _ in iso["requests"]], dtype=float)
    ttft_ms = np.array(iso["ttft_per_token_ms_all"]) * lens
    per_token, base = np.polyfit(lens, ttft_ms, 1)
    return {"ttft_base": SLO_FACTOR * max(base, 0.0), "ttft": SLO_FACTOR * per_token, "tpot": tpot}


def start_server(label: str, flags: list[str], args, slo: dict) -> tuple[ServerProcess, int]:
    """`bullet serve` for one configuration, healthy, with its step log; (server, port)."""
    port = free_port()
    step_log = args.out / f"{label}.steps.jsonl"
    step_log.unlink(missing_ok=True)
    serve = [sys.executable, "-m", "bulletserve.cli", "serve", "--port", str(port)]
    serve += ["--max-model-len", str(args.max_model_len), *slo_flags(slo)]
    serve += ["--step-log", str(step_log), "--log-level", "warning", *flags]
    if args.hardware_profile:
        serve += ["--hardware-profile", str(args.hardware_profile)]
    server = ServerProcess(serve, port, args.out / f"{label}.serve.log")
    try:
        server.wait_ready(300, poll_s=1)
        _warm_up(port)
    except BaseException:
        server.stop(120)
        raise
    return server, port


def _warm_up(port: int) -> None:
    """One short completion, so that no configuration's first measured requests pay for the
    server's first step (allocator growth, first-touch pages)."""
    body = json.dumps({"prompt": "Hello there", "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def slo_flags(slo: dict) -> list[str]:
    return [
        *("--slo-ttft-per-token-ms", f"{slo['ttft']:.3f}"),
        *("--slo-ttft-base-ms", f"{slo['ttft_base']:.1f}"),
        *("--slo-tpot-ms", f"{slo['tpot']:.1f}"),
    ]


def run_bench(label: str, port: int, rates: str, out: Path, args, slo: dict) -> Path:
    """`bullet bench` of the sharegpt-like workload at `rates` against the server on `port`."""
    bench = [sys.executable, "-m", "bulletserve.cli", "bench"]
    bench += ["--base-url", f"http://127.0.0.1:{port}"]
    bench += ["--dataset", "sharegpt-like", "--num-prompts", str(args.num_prompts)]
    bench += ["--request-rates", rates, "--ignore-eos", "--seed", str(args.seed)]
    bench += [*slo_flags(slo), "--label", label, "--output", str(out), "--no-progress"]
    result = subprocess.run(bench, capture_output=True, text=True, timeout=args.timeout)
    out.with_suffix(".bench.txt").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{label}: bench failed:\n{result.stderr[-2000:]}")
    return out


def run_config(label: str, flags: list[str], args, slo: dict) -> Path:
    """One server, every rate."""
    server, port = start_server(label, flags, args, slo)
    try:
        return run_bench(label, port, args.rates, args.out / f"{label}.json", args, slo)
    finally:
        server.stop(120)


def run_interleaved(labels: list[str], args, slo: dict) -> list[Path]:
    """Every configuration's server up at once (idle ones take no CPU), then each rate runs
    against every configuration back to back, the order rotating from rate to rate (and from
    repeat to repeat): a slow spell of the machine then falls on all configurations of a rate
    alike, not on whichever configuration a one-server-at-a-time sweep happened to be running.
    With `--repeats N` the whole round of rates runs N times, the same requests each time."""
    from bulletserve.bench.records import BenchResult, load_result

    servers = {}
    try:
        for label in labels:
            servers[label] = start_server(label, CONFIGS[label], args, slo)
        parts: dict[str, list[Path]] = {label: [] for label in labels}
        rates = args.rates.split(",")
        for repeat in range(args.repeats):
            for i, rate in enumerate(rates):
                turn = (i + repeat) % len(labels)
                for label in labels[turn:] + labels[:turn]:
                    suffix = f".rep-{repeat}" if args.repeats > 1 else ""
                    out = args.out / f"{label}.rate-{rate}{suffix}.json"
                    if args.profile_each_run:
                        profile_now(out.with_suffix(".profile.json"), args.profile_each_run)
                    parts[label].append(run_bench(label, servers[label][1], rate, out, args, slo))
                    print(f"{label} at {rate} req/s done{suffix}", flush=True)
    finally:
        for server, _ in servers.values():
            server.stop(120)
    files = []
    for label, paths in parts.items():
        results = [load_result(path) for path in paths]
        merged = BenchResult(
            label=label,
            config=results[0].config,
            runs=[run for result in results for run in result.runs],
        )
        merged.save(args.out / f"{label}.json")
        files.append(args.out / f"{label}.json")
    return files


def profile_now(path: Path, plan: str) -> None:
    """`bullet profile` of this CPU now (`plan`: quick or full), for the simulator to replay
    the next run on the machine's speed of the moment (it swung 2x within half an hour)."""
    cli = [sys.executable, "-m", "bulletserve.cli", "profile", "--device", "cpu"]
    cli += ["--quick"] if plan == "quick" else []
    result = subprocess.run(cli + ["--output", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"bullet profile failed:\n{result.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("docs/data/bench-cpu"))
    parser.add_argument("--rates", default="0.5,1,1.5,2,3")
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--max-model-len", type=int, default=768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--hardware-profile", type=Path, default=None)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--slo-mode", choices=("affine", "per-token"), default="affine")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="every server up at once; each rate runs against every configuration in turn",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --interleave: run every rate against every configuration this many times "
        "(the same requests; `bullet bench table` then reports medians over the repeats)",
    )
    parser.add_argument(
        "--profile-each-run",
        nargs="?",
        const="quick",
        choices=("quick", "full"),
        help="with --interleave: a `bullet profile` (quick unless `full`: about 30 s or 80 s "
        "on 2 cores) before every run, saved beside it as LABEL.rate-R.profile.json (for "
        "bullet simulate fidelity --profile-per-run)",
    )
    args = parser.parse_args()
    if args.profile_each_run and not args.interleave:
        parser.error("--profile-each-run needs --interleave")
    if args.repeats < 1 or (args.repeats > 1 and not args.interleave):
        parser.error("--repeats takes a positive count, and more than 1 needs --interleave")
    if args.repeats > 1 and args.profile_each_run:
        parser.error("--profile-each-run takes one run per rate (the replay matches by rate)")
    args.out.mkdir(parents=True, exist_ok=True)
    iso_path = args.out / "isolated.json"
    if not iso_path.exists():
        iso_path.write_text(
            json.dumps(isolated_latencies(args.max_model_len, 12, args.seed), indent=2)
        )
    iso = json.loads(iso_path.read_text())
    slo = slos(iso, args.slo_mode)
    print(
        f"isolated: {iso['ttft_per_token_ms']:.3f} ms/token TTFT (P90), "
        f"{iso['tpot_ms']:.1f} ms TPOT (median); SLOs ({args.slo_mode}) x{SLO_FACTOR}: TTFT "
        f"{slo['ttft_base']:.1f} ms + {slo['ttft']:.3f} ms/token, TPOT {slo['tpot']:.1f} ms",
        flush=True,
    )
    labels = args.configs.split(",")
    if args.interleave:
        files = run_interleaved(labels, args, slo)
    else:
        files = []
        for label in labels:
            started = time.time()
            files.append(run_config(label, CONFIGS[label], args, slo))
            print(f"{label}: {time.time() - started:.0f} s", flush=True)
    if args.repeats > 1:  # `bullet bench compare` would show one run per rate
        print(f"medians over the repeats: bullet bench table {' '.join(map(str, files))}")
        return
    cli = [sys.executable, "-m", "bulletserve.cli", "bench"]
    print(
        subprocess.run(cli + ["compare", *map(str, files)], capture_output=True, text=True).stdout
    )


if __name__ == "__main__":
    main()
