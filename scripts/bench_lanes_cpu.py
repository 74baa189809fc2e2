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
2. For each configuration: start `bullet serve` (default model, bf16, --step-log), sweep the
   request rates with `bullet bench`, stop the server.
3. Plots and a comparison table.

    python scripts/bench_lanes_cpu.py --out docs/data/bench-cpu --rates 0.5,1,1.5,2,3
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SLO_FACTOR = 5.0
CONFIGS = {
    "bullet": ["--policy", "bullet"],
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("server did not become healthy")


def run_config(label: str, flags: list[str], args, slo: dict) -> Path:
    port = _free_port()
    out = args.out / f"{label}.json"
    step_log = args.out / f"{label}.steps.jsonl"
    step_log.unlink(missing_ok=True)
    cli = [sys.executable, "-m", "bulletserve.cli"]
    serve = cli + ["serve", "--port", str(port), "--max-model-len", str(args.max_model_len)]
    slo_flags = ["--slo-ttft-per-token-ms", f"{slo['ttft']:.3f}"]
    slo_flags += ["--slo-ttft-base-ms", f"{slo['ttft_base']:.1f}"]
    slo_flags += ["--slo-tpot-ms", f"{slo['tpot']:.1f}"]
    serve += slo_flags
    serve += ["--step-log", str(step_log), "--log-level", "warning", *flags]
    if args.hardware_profile:
        serve += ["--hardware-profile", str(args.hardware_profile)]
    with open(args.out / f"{label}.serve.log", "w") as log:
        server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(port, server, 300)
            bench = cli + ["bench", "--base-url", f"http://127.0.0.1:{port}"]
            bench += ["--dataset", "sharegpt-like", "--num-prompts", str(args.num_prompts)]
            bench += ["--request-rates", args.rates, "--ignore-eos", "--seed", str(args.seed)]
            bench += [*slo_flags, "--label", label]
            bench += ["--output", str(out), "--no-progress"]
            result = subprocess.run(bench, capture_output=True, text=True, timeout=args.timeout)
            (args.out / f"{label}.bench.txt").write_text(result.stdout + result.stderr)
            if result.returncode != 0:
                raise RuntimeError(f"{label}: bench failed:\n{result.stderr[-2000:]}")
        finally:
            server.terminate()
            server.wait(timeout=120)
    return out


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
    args = parser.parse_args()
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
    files = []
    for label in args.configs.split(","):
        started = time.time()
        files.append(run_config(label, CONFIGS[label], args, slo))
        print(f"{label}: {time.time() - started:.0f} s", flush=True)
    cli = [sys.executable, "-m", "bulletserve.cli", "bench"]
    print(
        subprocess.run(cli + ["compare", *map(str, files)], capture_output=True, text=True).stdout
    )


if __name__ == "__main__":
    main()
