"""Served decode steps, bullet's decode lane against the single-lane chunked engine, A/B.

Both servers run at once (default model, --step-log); each round sends the same load to one,
then the other, so that the machine's slow spells fall on both alike. `--load closed`: a fixed
batch, `--concurrency` streams of `--input-len` random tokens generating `--output-len` each
(every full decode step has the same shape in both engines); `--load poisson`: sharegpt-like
requests at `--rate` (the lanes benchmark's workload). Per run it reports the median runner
time of decode steps that ran alone on every unit, by batch size (bins of 4 rows; closed: the
full batch only), and the server's per-thread CPU seconds and context switches; at the end the
bullet / chunked ratio of the per-run medians, per bin.

    .venv/bin/python scripts/served_decode_ab.py --out /tmp/ab --load closed --rounds 4 \\
        --hardware-profile docs/data/cpu-profile-2026-11-30r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from analyze_step_log import runner_s, whole_device_decodes
from bench_lanes_cpu import start_server, stop_server

TICKS = os.sysconf("SC_CLK_TCK")
BIN_ROWS = 4
CONFIGS = {
    "chunked-128": ["--policy", "chunked", "--chunked-prefill-size", "128"],
    "bullet": ["--policy", "bullet"],
}


def thread_counters(pid: int) -> dict[int, tuple[float, int, int]]:
    """tid -> (CPU seconds, voluntary, involuntary context switches) so far."""
    counters = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
        except OSError:  # the thread ended
            continue
        counters[int(task.name)] = (
            (int(fields[11]) + int(fields[12])) / TICKS,
            int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]),
        )
    return counters


def busy_threads(before: dict, after: dict) -> list[tuple[float, int, int]]:
    """(CPU s, voluntary, involuntary switches) per thread over the run, busiest first; idle
    threads left out."""
    deltas = []
    for tid, (cpu, vol, nonvol) in after.items():
        cpu0, vol0, nonvol0 = before.get(tid, (0.0, 0, 0))
        delta = (round(cpu - cpu0, 2), vol - vol0, nonvol - nonvol0)
        if delta[0] >= 0.05 or delta[1] >= 100 or delta[2] >= 20:
            deltas.append(delta)
    return sorted(deltas, reverse=True)


def decode_bins(steps: list[dict], full_batch: int | None) -> dict[int, list[float]]:
    """Runner ms of `whole_device_decodes` (a prefill step's end never falls inside them), by
    batch-size bin; with `full_batch`, of that batch size only."""
    bins: dict[int, list[float]] = defaultdict(list)
    for step, _ in whole_device_decodes(steps):
        if full_batch is None or step["batch_size"] == full_batch:
            bins[step["batch_size"] // BIN_ROWS * BIN_ROWS].append(runner_s(step) * 1e3)
    return bins


def bench_command(args: argparse.Namespace, port: int, seed: int) -> list[str]:
    command = [sys.executable, "-m", "bulletserve.cli", "bench", "--no-progress"]
    command += ["--base-url", f"http://127.0.0.1:{port}", "--seed", str(seed)]
    if args.load == "closed":
        command += ["--dataset", "random", "--range-ratio", "0", "--ignore-eos"]
        command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        command += ["--request-rate", "inf", "--max-concurrency", str(args.concurrency)]
    else:
        command += ["--dataset", "sharegpt-like", "--request-rate", str(args.rate)]
    return command + ["--num-prompts", str(args.num_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--load", choices=("closed", "poisson"), default="closed")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8, help="closed: the batch")
    parser.add_argument("--input-len", type=int, default=64, help="closed")
    parser.add_argument("--output-len", type=int, default=96, help="closed")
    parser.add_argument("--rate", type=float, default=1.5, help="poisson: requests/s")
    parser.add_argument("--max-model-len", type=int, default=768)
    parser.add_argument("--hardware-profile", type=Path, default=None)
    parser.add_argument("--slo-ttft-ms", type=float, default=165.0, help="fixed part")
    parser.add_argument("--slo-ttft-per-token-ms", type=float, default=10.7)
    parser.add_argument("--slo-tpot-ms", type=float, default=240.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    slo = {"ttft": args.slo_ttft_per_token_ms, "ttft_base": args.slo_ttft_ms}
    slo["tpot"] = args.slo_tpot_ms
    full_batch = args.concurrency if args.load == "closed" else None
    servers = {}
    try:
        for label, flags in CONFIGS.items():
            servers[label] = start_server(label, flags, args, slo)
        medians: dict[str, dict[int, list[float]]] = {label: defaultdict(list) for label in CONFIGS}
        for round_index in range(args.rounds):
            for label, (server, port) in servers.items():
                step_log = args.out / f"{label}.steps.jsonl"
                done = len(step_log.read_text().splitlines())
                before = thread_counters(server.pid)
                subprocess.run(bench_command(args, port, round_index), check=True)
                threads = busy_threads(before, thread_counters(server.pid))
                steps = [json.loads(line) for line in step_log.read_text().splitlines()[done:]]
                bins = decode_bins(steps, full_batch)
                for rows, runner_ms in bins.items():
                    medians[label][rows].append(statistics.median(runner_ms))
                shown = {
                    r: (len(v), round(statistics.median(v), 1)) for r, v in sorted(bins.items())
                }
                print(f"round {round_index} {label}: decode steps by rows (count, median ms)")
                print(f"  {shown}")
                print(f"  threads (CPU s, voluntary, involuntary switches): {threads}", flush=True)
    finally:
        for server, _ in servers.values():
            stop_server(server)
    bullet, chunked = medians["bullet"], medians["chunked-128"]
    for rows in sorted(set(bullet) & set(chunked)):
        ratio = statistics.median(bullet[rows]) / statistics.median(chunked[rows])
        print(
            f"rows {rows}-{rows + BIN_ROWS - 1}: bullet {[round(v, 1) for v in bullet[rows]]}"
            f" chunked-128 {[round(v, 1) for v in chunked[rows]]} bullet / chunked {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
