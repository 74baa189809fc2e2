"""CPU time per process and per thread while a benchmark runs, from /proc (Linux).

Samples every thread of the processes whose command line contains one of the --match strings,
every --interval seconds, until none has been seen for --idle seconds or --max-seconds pass,
and prints each process's CPU use in cores over the sampled span and its busiest threads:
what the server's host threads and the benchmark client take from the cores the model runs on.

    python scripts/thread_cpu.py --match "bulletserve.cli serve" --match "bulletserve.cli bench" \\
        --out cpu.jsonl &
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def matching_pids(patterns: list[str]) -> dict[int, str]:
    """pid -> the first pattern its command line contains."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for pattern in patterns:
            if pattern in cmdline:
                found[int(entry.name)] = pattern
                break
    return found


def thread_seconds(pid: int) -> dict[int, float]:
    """tid -> user + system CPU seconds so far."""
    seconds = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return seconds
    for task in tasks:
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


def sample(patterns: list[str], interval: float, idle: float, max_seconds: float, out: Path):
    start = last_seen = time.monotonic()
    with out.open("w") as f:
        while time.monotonic() - start < max_seconds and time.monotonic() - last_seen < idle:
            pids = matching_pids(patterns)
            if pids:
                last_seen = time.monotonic()
            record = {
                "time": time.monotonic(),
                "processes": {
                    str(pid): {"match": pattern, "threads": thread_seconds(pid)}
                    for pid, pattern in pids.items()
                },
            }
            f.write(json.dumps(record) + "\n")
            f.flush()
            time.sleep(interval)


def report(path: Path, top: int) -> None:
    """CPU cores used per process and per busiest thread, first to last sample of each."""
    first: dict[str, tuple[float, dict]] = {}
    last: dict[str, tuple[float, dict]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for pid, proc in record["processes"].items():
            first.setdefault(pid, (record["time"], proc))
            last[pid] = (record["time"], proc)
    for pid, (t0, proc0) in first.items():
        t1, proc1 = last[pid]
        span = t1 - t0
        if span <= 0:
            continue
        busy = {
            tid: seconds - proc0["threads"].get(tid, 0.0)
            for tid, seconds in proc1["threads"].items()
        }
        total = sum(busy.values())
        print(f"{proc1['match']} (pid {pid}): {total / span:.2f} cores over {span:.0f} s")
        for tid, seconds in sorted(busy.items(), key=lambda item: -item[1])[:top]:
            print(f"    thread {tid}: {seconds / span:.2f} cores")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--match", action="append", default=[], help="command-line substring")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--idle", type=float, default=60.0, help="stop after this long unmatched")
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=Path("thread-cpu.jsonl"))
    parser.add_argument("--report", type=Path, help="print the report of a sampled file and exit")
    parser.add_argument("--top", type=int, default=6, help="threads listed per process")
    args = parser.parse_args()
    if args.report:
        report(args.report, args.top)
        return
    if not args.match:
        parser.error("give at least one --match")
    sample(args.match, args.interval, args.idle, args.max_seconds, args.out)


if __name__ == "__main__":
    main()
