"""One-call device check for the lanes issue (see scripts/device_check.sh).

Stages, each printing rows of one table and writing JSON to --out:
  splits: green-context splits; an n^3 GEMM's rate on each SM count, and two saturating GEMMs
          co-running on disjoint groups (their rates should add up to about the whole GPU's)
  steps:  a dummy model's prefill and decode step latency at three splits, alone and co-running
  offline: LLM.generate per policy without the server, with CUDA graphs and --enforce-eager, and
          chunked under --async-scheduling; each run's decode busy share (see bench), and a
          torch.profiler table of the eager chunked run
  bench:  `bullet serve` + `bullet bench` at two rates, bullet vs chunked (1024-token chunks,
          serial steps and --async-scheduling),
          and each server's decode busy share: of its step log's span, the time a step with
          decode rows ran (the rest the device waited on the host, ran prompts alone, or idled)

On a CPU (`--device cpu`) the same code runs with threads as units, which is how it is tested
where no GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import torch

from bulletserve.bookkeeping.record import decode_busy_share, read_step_log
from bulletserve.partition import unit_provider
from bulletserve.partition.measure import gemm_rate
from bulletserve.profiling.steps import StepBench


def _rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    if rows:
        keys = list(next((r for r in rows if "error" not in r), rows[0]))
        print(" | ".join(f"{k:>14}" for k in keys))
        for row in rows:
            if "error" in row:
                print(f"  FAILED {row}")
                continue
            print(
                " | ".join(
                    f"{row[k]:>14.4g}" if isinstance(row[k], float) else f"{row[k]!s:>14}"
                    for k in keys
                )
            )


def _splits(units, counts: list[int], gemm_n: int) -> list[int]:
    valid = [c for c in counts if c < units.total]
    return valid or [max(units.total // 2, units.min_units)]


def stage_splits(args, units) -> list[dict]:
    rows = []
    counts = sorted({units.min_units, *args.sm_counts, units.total})
    for count in [c for c in counts if c <= units.total]:
        rate = gemm_rate(units, args.gemm_n, torch.bfloat16, count, 5)
        rows.append({"units": count, "gemm_TFLOPs": rate / 1e12})
    whole = rows[-1]["gemm_TFLOPs"]
    for row in rows:
        row["vs_whole"] = row["gemm_TFLOPs"] / whole
    half = _splits(units, [units.total // 2 // units.granularity * units.granularity], args.gemm_n)[
        0
    ]
    results: dict[str, float] = {}

    def run(rest: bool) -> None:
        a = torch.randn(args.gemm_n, args.gemm_n, device=units.device, dtype=torch.bfloat16)
        with units.lane(half, rest=rest):
            for _ in range(3):
                torch.mm(a, a)
            units.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                torch.mm(a, a)
            units.synchronize()
            results["rest" if rest else "group"] = (
                20 * 2 * args.gemm_n**3 / (time.perf_counter() - start)
            )

    threads = [threading.Thread(target=run, args=(rest,)) for rest in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    both = (results["group"] + results["rest"]) / 1e12
    rows.append({"units": f"{half}+rest", "gemm_TFLOPs": both, "vs_whole": both / whole})
    return rows


def stage_steps(args, units) -> list[dict]:
    from bulletserve.model.loader import load_model
    from bulletserve.model.source import resolve_model

    model = load_model(resolve_model(args.model, "dummy"), torch.bfloat16, units.device, 8192)
    bench = StepBench(
        model, units, max_tokens=args.prefill_len + args.decode_batch * args.context + 64
    )
    rows = []
    splits = _splits(units, args.splits, args.gemm_n)
    for prefill_units in splits:
        decode_units = units.total - prefill_units
        p_alone = bench.alone(bench.prefill_works([args.prefill_len]), prefill_units, 3)
        d_alone = bench.alone(bench.decode_works(args.decode_batch, args.context), decode_units, 5)
        p_co, d_co = bench.corun(
            bench.prefill_works([args.prefill_len]),
            prefill_units,
            bench.decode_works(args.decode_batch, args.context),
            3,
        )
        rows.append(
            {
                "split_P/D": f"{prefill_units}/{decode_units}",
                "prefill_ms": p_alone * 1e3,
                "prefill_co_ms": p_co * 1e3,
                "decode_ms": d_alone * 1e3,
                "decode_co_ms": d_co * 1e3,
            }
        )
    return rows


def stage_offline(args, out: Path) -> list[dict]:
    """`LLM.generate` without the server, per policy: where a step's time goes when the
    bench's numbers look wrong (a torch.profiler table of the chunked run goes to the log)."""
    from bulletserve import LLM, SamplingParams

    rows = []
    prompts = [[(i * 7919 + j * 104729) % 40000 + 5 for j in range(128)] for i in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    graphs_too = [False, True] if args.device == "cuda" else [False]
    runs = [(p, g, False) for p in ("chunked", "bullet") for g in graphs_too]
    runs.append(("chunked", args.device == "cuda", True))  # --async-scheduling
    for policy, graphs, overlapped in runs:
        name = f"{policy}{'-graphs' if graphs else ''}{'-async' if overlapped else ''}"
        step_log = out / f"offline-steps-{name}.jsonl"
        llm = LLM(
            model=args.model,
            load_format="dummy",
            device=args.device,
            tokenizer=args.tokenizer,
            max_model_len=1024,
            policy=policy,
            enforce_eager=not graphs,
            async_scheduling=overlapped,
            hardware_profile=args.hardware_profile if policy == "bullet" else None,
            step_log=str(step_log),
        )
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        profiler = None
        if policy == "chunked" and not graphs and not overlapped:
            profiler = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            profiler.start()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        if profiler is not None:
            profiler.stop()
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
            print(table)
            (out / "offline-profile.txt").write_text(table)
        tokens = sum(len(o.token_ids) for o in outputs)
        rows.append(
            {
                "policy": policy,
                "cuda_graphs": graphs,
                "async": overlapped,
                "seconds": seconds,
                "out_tok_per_s": tokens / seconds,
                # Of the whole log (the warm-up's steps too): the device's share decoding.
                "decode_busy": decode_busy_share(read_step_log(step_log)),
            }
        )
        close = getattr(llm.engine, "close", None)
        if close is not None:
            close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, deadline: float) -> None:
    """Poll /health until the server answers; raise if it exits or the deadline passes."""
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} (see its log)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError("the server did not become healthy in time")


def bench_servers(labels: str, hardware_profile: str | None) -> list[tuple[str, list[str]]]:
    """(label, serve flags) per label of --bench-policies, all checked before any server runs."""
    profile = ["--hardware-profile", hardware_profile] if hardware_profile else []
    servers = []
    for label in labels.split(","):
        if label == "bullet":
            servers.append((label, ["--policy", "bullet", *profile]))
        elif label == "bullet-no-fuse":
            servers.append((label, ["--policy", "bullet", "--no-fuse-decode", *profile]))
        elif (
            label.startswith("chunked-")
            and label.removeprefix("chunked-").removesuffix("-async").isdigit()
        ):
            size = label.removeprefix("chunked-").removesuffix("-async")
            flags = ["--policy", "chunked", "--chunked-prefill-size", size]
            if label.endswith("-async"):
                flags.append("--async-scheduling")
            servers.append((label, flags))
        else:
            raise SystemExit(
                f"--bench-policies: {label!r} is not bullet, bullet-no-fuse, chunked-N or "
                "chunked-N-async"
            )
    return servers


def stage_bench(args, out: Path) -> list[dict]:
    rows = []
    base = [sys.executable, "-m", "bulletserve.cli"]
    for label, policy in bench_servers(args.bench_policies, args.hardware_profile):
        port = _free_port()
        log = open(out / f"serve-{label}.log", "w")
        server = subprocess.Popen(
            base
            + [
                "serve",
                "--load-format",
                "dummy",
                "--model",
                args.model,
                "--device",
                args.device,
                "--port",
                str(port),
                "--max-model-len",
                "4096",
                "--step-log",
                str(out / f"steps-{label}.jsonl"),
            ]
            + policy
            + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
            + args.server_flags.split(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            command = base + [
                "bench",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--dataset",
                args.dataset,
                "--num-prompts",
                str(args.num_prompts),
                "--request-rates",
                args.rates,
                "--ignore-eos",
                "--label",
                label,
                "--output",
                str(out / f"bench-{label}.json"),
                "--no-progress",
                "--slo-ttft-per-token-ms",
                "3.0",
                "--slo-tpot-ms",
                "150",
                "--max-model-len",
                str(args.bench_max_model_len),
            ]
            if args.tokenizer:
                command += ["--tokenizer", args.tokenizer]
            try:
                _wait_healthy(server, port, deadline=time.time() + 300)
            except RuntimeError as exc:
                rows.append({"policy": label, "error": str(exc)})
                continue
            try:
                result = subprocess.run(
                    command, capture_output=True, text=True, timeout=args.bench_timeout
                )
            except subprocess.TimeoutExpired:
                rows.append({"policy": label, "error": f"bench over {args.bench_timeout} s"})
                continue
            (out / f"bench-{label}.txt").write_text(result.stdout + result.stderr)
            if result.returncode != 0:
                rows.append({"policy": label, "error": result.stderr.strip()[-300:]})
                continue
            data = json.loads((out / f"bench-{label}.json").read_text())
            # How much of the server's stepping the device spent decoding (both rates' runs
            # in one log): what the host's time between steps leaves.
            busy = decode_busy_share(read_step_log(out / f"steps-{label}.jsonl"))
            for run in data["runs"]:
                s = run["summary"]
                rows.append(
                    {
                        "policy": label,
                        "rate": run["request_rate"],
                        "tok_per_s": s["output_throughput"],
                        "attain": s["slo"]["attainment"],
                        "p90_ttft_ms": s["ttft_ms"]["p90"],
                        "p90_tpot_ms": s["tpot_ms"]["p90"],
                        "decode_busy": busy,
                    }
                )
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stages", nargs="+", choices=("splits", "steps", "offline", "bench"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device-check")))
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--gemm-n", type=int, default=8192)
    parser.add_argument("--sm-counts", type=int, nargs="*", default=[16, 32, 64, 96])
    parser.add_argument("--splits", type=int, nargs="*", default=[32, 64, 96], help="prefill units")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dataset", default="sharegpt-like")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--rates", default="10,20")
    parser.add_argument("--bench-timeout", type=int, default=200)
    parser.add_argument(
        "--bench-max-model-len", type=int, default=1024, help="requests fitted to this context"
    )
    parser.add_argument(
        "--server-flags", default="", help="more `bullet serve` flags for both servers"
    )
    parser.add_argument(
        "--bench-policies",
        default="bullet,chunked-1024,chunked-1024-async",
        help="servers to bench, in order: bullet, bullet-no-fuse (--no-fuse-decode), chunked-N, "
        "chunked-N-async (with --async-scheduling)",
    )
    parser.add_argument(
        "--hardware-profile", default=None, help="a `bullet profile` JSON for the bullet server"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer folder (where the default model is absent)"
    )
    args = parser.parse_args()
    bench_servers(args.bench_policies, args.hardware_profile)
    args.out.mkdir(parents=True, exist_ok=True)
    units = unit_provider(torch.device(args.device))
    report_file = args.out / "device_check.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    for stage in args.stages:
        started = time.time()
        try:
            if stage == "splits":
                rows = stage_splits(args, units)
            elif stage == "steps":
                rows = stage_steps(args, units)
            elif stage == "offline":
                rows = stage_offline(args, args.out)
            else:
                rows = stage_bench(args, args.out)
        except Exception as exc:  # one failed stage must not hide the others' results
            traceback.print_exc()
            rows = [{"error": f"{type(exc).__name__}: {exc}"}]
        report[stage] = rows
        _rows(f"{stage} ({time.time() - started:.0f} s, {units.kind}, {units.total} units)", rows)
        report_file.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
