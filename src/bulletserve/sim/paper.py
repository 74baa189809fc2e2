"""The Bullet paper's setting, simulated: A100-80GB, Llama-3.1-8B, three workloads at Poisson
10 to 25 req/s, 1000 requests, the paper's SLOs; Bullet against chunked prefill (1024 and 2048)
and prefill-first. Prints markdown tables and writes one plot per workload.

bullet simulate paper --out docs [--results DIR] [--num-prompts 1000]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from bulletserve.bench.datasets import PAPER_SLOS, dataset_family  # noqa: E402
from bulletserve.bench.records import BenchResult  # noqa: E402
from bulletserve.bench.report import lookup  # noqa: E402
from bulletserve.sim.benchmark import SimConfig, simulate  # noqa: E402

RATES = (10.0, 12.5, 15.0, 17.5, 20.0, 22.5, 25.0)
POLICIES: tuple[tuple[str, int | None], ...] = (
    ("bullet", None),
    ("chunked", 1024),
    ("chunked", 2048),
    ("prefill-first", None),
)
# (column title, path into a run summary, scale)
COLUMNS = (
    ("req/s", ("request_throughput",), 1.0),
    ("out tok/s", ("output_throughput",), 1.0),
    ("mean TTFT ms", ("ttft_ms", "mean"), 1.0),
    ("P90 TTFT ms", ("ttft_ms", "p90"), 1.0),
    ("mean TPOT ms", ("tpot_ms", "mean"), 1.0),
    ("P90 TPOT ms", ("tpot_ms", "p90"), 1.0),
    ("SLO att. %", ("slo", "attainment"), 100.0),
)


def run_workload(
    dataset: str, num_prompts: int, rates: Sequence[float], results: Path | None
) -> list[BenchResult]:
    slo = PAPER_SLOS[dataset_family(dataset) or ""]
    out = []
    for policy, chunk in POLICIES:
        config = SimConfig(
            hardware="a100-80g",
            model="llama-3.1-8b",
            policy=policy,
            dataset=dataset,
            num_prompts=num_prompts,
            request_rates=tuple(rates),
            chunked_prefill_size=chunk,
            slo=slo,
        )
        result = simulate(config)
        if results is not None:
            result.save(results / f"{dataset}-{result.label}.json")
        out.append(result)
    return out


def table(results: Sequence[BenchResult]) -> str:
    head = "| policy | rate | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for result in results:
        for run in result.runs:
            cells = []
            for _, path, scale in COLUMNS:
                value = lookup(run.summary, path)
                cells.append("-" if value is None else f"{value * scale:.1f}")
            lines.append(f"| {result.label} | {run.request_rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(results: Sequence[BenchResult], baseline: str = "chunked-1024") -> str:
    """Bullet against the baseline, as the paper states its results: mean and max throughput
    ratio over the rates, and the ratio of mean TTFTs averaged over the rates."""
    by_label = {r.label: r for r in results}
    bullet, base = by_label["bullet"], by_label[baseline]
    thr = [
        b.summary["request_throughput"] / c.summary["request_throughput"]
        for b, c in zip(bullet.runs, base.runs, strict=True)
    ]
    ttft = [
        c.summary["ttft_ms"]["mean"] / b.summary["ttft_ms"]["mean"]
        for b, c in zip(bullet.runs, base.runs, strict=True)
    ]
    return (
        f"bullet vs {baseline}: throughput {sum(thr) / len(thr):.3f}x on average "
        f"(max {max(thr):.3f}x); mean TTFT {sum(ttft) / len(ttft):.2f}x lower on average"
    )


def plot(results: Sequence[BenchResult], dataset: str, path: Path) -> Path:
    panels = [COLUMNS[1], COLUMNS[2], COLUMNS[5], COLUMNS[6]]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (title, key, scale) in zip(axes, panels, strict=True):
        for result in results:
            points = [(run.request_rate, lookup(run.summary, key)) for run in result.runs]
            xs = [x for x, y in points if y is not None]
            ys = [y * scale for _, y in points if y is not None]
            ax.plot(xs, ys, marker="o", linestyle="--", label=result.label)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    hardware = results[0].hardware
    fig.suptitle(f"simulated on {hardware}: Llama-3.1-8B, {dataset}, 1000 requests, Poisson")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclasses.dataclass(frozen=True)
class Settings:
    """`bullet simulate paper`'s settings (its flags: cli/simulate.py)."""

    out: Path  # the folder for sim-WORKLOAD.png
    results: Path | None
    num_prompts: int
    workloads: str  # comma-separated


def main(settings: Settings) -> int:
    """`bullet simulate paper`: a table and a plot per workload."""
    settings.out.mkdir(parents=True, exist_ok=True)
    if settings.results:
        settings.results.mkdir(parents=True, exist_ok=True)
    for dataset in settings.workloads.split(","):
        start = time.perf_counter()
        results = run_workload(dataset, settings.num_prompts, RATES, settings.results)
        slo = PAPER_SLOS[dataset_family(dataset) or ""]
        print(f"\n### {dataset} (SLO {slo.ttft_per_token_ms} ms/token, {slo.tpot_ms} ms TPOT)\n")
        print(table(results))
        print(f"\n{ratios(results)}; {ratios(results, 'chunked-2048')}")
        print(f"plot: {plot(results, dataset, settings.out / f'sim-{dataset}.png')}")
        print(f"(simulated in {time.perf_counter() - start:.0f} s)")
    return 0
