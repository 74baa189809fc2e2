"""PNG plots of one or more result files: sweep curves, latency CDFs and a TTFT timeline.

Every result is one line, named by its label; simulated results are drawn dashed and labeled
with their hardware, so measured and simulated curves can share a figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bulletserve.bench.records import BenchResult, RunResult  # noqa: E402
from bulletserve.bench.report import lookup, rate_name  # noqa: E402
from bulletserve.bench.serving_metrics import tpot_s  # noqa: E402

# (file name, y-axis title, path into the summary, scale)
SWEEP_PLOTS = (
    ("attainment.png", "SLO attainment (%)", ("slo", "attainment"), 100.0),
    ("throughput.png", "Output throughput (tok/s)", ("output_throughput",), 1.0),
    ("p90_ttft.png", "P90 TTFT (ms)", ("ttft_ms", "p90"), 1.0),
    ("p90_tpot.png", "P90 TPOT (ms)", ("tpot_ms", "p90"), 1.0),
)


def plot_results(results: Sequence[BenchResult], out_dir: Path) -> list[Path]:
    """Write all plots for these results into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        path
        for name, ylabel, key, scale in SWEEP_PLOTS
        if (path := _sweep_plot(results, out_dir / name, ylabel, key, scale)) is not None
    ]
    if (path := _class_plot(results, out_dir / "classes.png")) is not None:
        written.append(path)
    written.append(_cdf_plot(results, out_dir / "latency_cdf.png"))
    written.append(_timeline_plot(results, out_dir / "ttft_timeline.png"))
    return written


def _style(result: BenchResult) -> dict:
    return {"linestyle": "--" if result.simulated else "-", "label": result.display_label}


def _finite_runs(result: BenchResult) -> list[RunResult]:
    return sorted(
        (run for run in result.runs if not math.isinf(run.request_rate)),
        key=lambda run: run.request_rate,
    )


def _sweep_plot(
    results: Sequence[BenchResult], path: Path, ylabel: str, key: tuple[str, ...], scale: float
) -> Path | None:
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for result in results:
        points = [(run.request_rate, lookup(run.summary, key)) for run in _finite_runs(result)]
        points = [(x, y * scale) for x, y in points if y is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", **_style(result))
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel(ylabel)
    # From zero: an axis fitted to the data drew 13.02 to 13.13 tok/s as a steep rise.
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _class_plot(results: Sequence[BenchResult], path: Path) -> Path | None:
    """A mixed workload's attainment and goodput per class against the rate: a color per
    result, a marker per class; None where no run has classes."""
    classes = sorted(
        {
            name
            for result in results
            for run in result.runs
            for name in run.summary.get("classes", {})
        }
    )
    if not classes:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    markers = dict(zip(classes, "os^vD<>p*h", strict=False))
    for index, result in enumerate(results):
        runs = _finite_runs(result)
        for name in classes:
            scores = [(run.request_rate, run.summary.get("classes", {}).get(name)) for run in runs]
            scores = [(x, score) for x, score in scores if score is not None]
            if not scores:
                continue
            xs = [x for x, _ in scores]
            style = _style(result) | {"color": f"C{index}", "marker": markers[name]}
            style["label"] = f"{style['label']}: {name}"
            attained = [100 * (score["attainment"] or 0.0) for _, score in scores]
            axes[0].plot(xs, attained, **style)
            axes[1].plot(xs, [score["goodput"] for _, score in scores], **style)
    for ax, ylabel in zip(
        axes, ("SLO attainment per class (%)", "Goodput per class (req/s)"), strict=True
    ):
        ax.set_xlabel("Request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cdf_plot(results: Sequence[BenchResult], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    metrics = (
        ("TTFT (ms)", lambda r: r.ttft_s),
        ("TPOT (ms)", tpot_s),
        ("E2E latency (ms)", lambda r: r.e2el_s),
    )
    for ax, (title, value) in zip(axes, metrics, strict=True):
        for result in results:
            for run in result.runs:
                values = (value(r) for r in run.requests if r.success)
                data = [v * 1000 for v in values if v is not None]
                if not data:
                    continue
                xs = np.sort(data)
                ys = np.arange(1, len(xs) + 1) / len(xs)
                style = _style(result)
                style["label"] += f" @ {rate_name(run.request_rate)}"
                ax.step(xs, ys, where="post", **style)
        ax.set_xlabel(title)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _timeline_plot(results: Sequence[BenchResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for result in results:
        for run in result.runs:
            done = [r for r in run.requests if r.success and r.ttft_s is not None]
            if not done:
                continue
            style = _style(result)
            ax.scatter(
                [r.arrival_s for r in done],
                [r.ttft_s * 1000 for r in done],
                s=8,
                marker="x" if result.simulated else "o",
                label=f"{style['label']} @ {rate_name(run.request_rate)}",
            )
    ax.set_xlabel("Arrival time in run (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
