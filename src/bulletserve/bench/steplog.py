"""The engine's step log (`bullet serve --step-log`) drawn beside the request timeline: how the
split between the prefill and decode lanes moved, and what each lane's steps cost."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from bulletserve.bench.records import BenchResult  # noqa: E402
from bulletserve.bookkeeping.record import read_step_log  # noqa: E402


def plot_step_log(step_log: Path, results: Sequence[BenchResult], path: Path) -> Path:
    """Three panels sharing a time axis (seconds from the first logged step, which is when the
    first request arrived): TTFT of each request by arrival, units per lane, step latency."""
    records = read_step_log(step_log)
    start = records[0].time
    fig, (ttft_ax, split_ax, step_ax) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for result in results:
        for run in result.runs:
            done = [r for r in run.requests if r.success and r.ttft_s is not None]
            ttft_ax.scatter(
                [r.arrival_s for r in done],
                [r.ttft_s * 1000 for r in done],
                s=8,
                label=result.display_label,
            )
    ttft_ax.set_ylabel("TTFT (ms)")
    for lane, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
        lane_records = [r for r in records if r.lane == lane]
        times = [r.time - start for r in lane_records]
        index = 0 if lane == "prefill" else 1
        split_ax.step(
            times,
            [r.split[index] for r in lane_records],
            where="post",
            color=color,
            label=f"{lane} units",
        )
        step_ax.scatter(
            times,
            [r.measured_s * 1000 for r in lane_records],
            s=4,
            color=color,
            label=f"{lane} step",
        )
    split_ax.set_ylabel("units")
    step_ax.set_ylabel("step latency (ms)")
    step_ax.set_xlabel("time (s)")
    for ax in (ttft_ax, split_ax, step_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
