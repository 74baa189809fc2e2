"""Capacity at an SLO, simulated (`bullet simulate capacity`): for each workload and policy,
the highest Poisson rate that keeps SLO attainment at or above a target, and Bullet's rate over
the best baseline's, on a modeled device (a preset or a measured profile).

Each (workload, policy, seed) walks its rate grid upwards and stops after two rates in a row
below the target; the attainment at a rate is the median over the seeds (a seed draws other
lengths and arrival times). A rate counts only if every grid rate below it also kept the target.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from bulletserve.bench.datasets import PAPER_SLOS, dataset_family, load_lengths  # noqa: E402
from bulletserve.sched import SchedulerConfig  # noqa: E402
from bulletserve.sched.bullet import RULE_NAMES, BulletPolicy  # noqa: E402
from bulletserve.sched.slo import SLO  # noqa: E402
from bulletserve.sim.benchmark import (  # noqa: E402
    SimConfig,
    make_sim_policy,
    setup,
    simulate_run,
)
from bulletserve.sim.defaults import CAPACITY_GRIDS, CAPACITY_TARGET  # noqa: E402
from bulletserve.sim.device_presets import SimSetupError  # noqa: E402

MISSES_BEFORE_STOP = 2


@dataclasses.dataclass(frozen=True)
class Task:
    """One walk up a rate grid: a workload, a policy label, a seed."""

    hardware: str
    model: str
    dataset: str
    policy: str
    seed: int
    num_prompts: int
    rates: tuple[float, ...]
    target: float
    slo: SLO | None = None  # None: the paper's SLOs for the workload
    dtype: str = "bfloat16"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    num_gpu_blocks_override: int | None = None
    device_memory_gib: float | None = None
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    host_s_per_step: float | None = None
    host_s_per_row: float | None = None
    host_overlap: bool = False


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """What a policy label means: the policy, chunked prefill's chunk, whether bullet fuses,
    and the rules an ablation takes out of bullet's table."""

    policy: str
    chunk: int | None = None
    fuse_decode: bool = True
    without_rules: tuple[str, ...] = ()


def policy_settings(label: str) -> PolicySettings:
    """A label: bullet, bullet-no-fuse (its `--no-fuse-decode`), bullet-without-RULE[+RULE...]
    (bullet's table less those rules, an ablation), prefill-first or chunked-N."""
    if label.startswith("chunked-"):
        size = label.removeprefix("chunked-")
        if not size.isdigit():
            raise ValueError(f"policy {label!r}: expected chunked-N with N a token count")
        return PolicySettings("chunked", int(size))
    if label in ("bullet", "prefill-first"):
        return PolicySettings(label)
    if label == "bullet-no-fuse":
        return PolicySettings("bullet", fuse_decode=False)
    if label.startswith("bullet-without-"):
        rules = tuple(label.removeprefix("bullet-without-").split("+"))
        unknown = [r for r in rules if r not in RULE_NAMES]
        if unknown or RULE_NAMES[-1] in rules:
            raise ValueError(
                f"policy {label!r}: expected rules of bullet's table other than its last "
                f"({', '.join(RULE_NAMES[:-1])})"
            )
        return PolicySettings("bullet", without_rules=rules)
    raise ValueError(
        f"policy {label!r}: expected bullet, bullet-no-fuse, bullet-without-RULE, prefill-first "
        "or chunked-N"
    )


def walk(task: Task) -> dict[float, float]:
    """Attainment at each rate of the grid, upwards, until MISSES_BEFORE_STOP rates in a row
    miss the target. One modeled device, policy and workload for the whole walk, as
    `runner.simulate` does for a sweep."""
    settings = policy_settings(task.policy)
    config = SimConfig(
        hardware=task.hardware,
        model=task.model,
        policy=settings.policy,
        chunked_prefill_size=settings.chunk,
        fuse_decode=settings.fuse_decode,
        dataset=task.dataset,
        num_prompts=task.num_prompts,
        request_rates=task.rates,
        slo=task.slo or PAPER_SLOS[dataset_family(task.dataset) or ""],
        seed=task.seed,
        dtype=task.dtype,
        quantization=task.quantization,
        tensor_parallel_size=task.tensor_parallel_size,
        max_model_len=task.max_model_len,
        num_gpu_blocks_override=task.num_gpu_blocks_override,
        device_memory_gib=task.device_memory_gib,
        max_num_seqs=task.max_num_seqs,
        host_s_per_step=task.host_s_per_step,
        host_s_per_row=task.host_s_per_row,
        host_overlap=task.host_overlap,
    )
    env = setup(config)
    sim_policy = make_sim_policy(config, env)
    if settings.without_rules:
        assert isinstance(sim_policy, BulletPolicy)
        kept = tuple(r for r in sim_policy.rules if r.name not in settings.without_rules)
        sim_policy = dataclasses.replace(sim_policy, rules=kept)
    lengths = load_lengths(
        config.dataset, config.num_prompts, config.seed, config.max_model_len, config.random_lengths
    )
    attained: dict[float, float] = {}
    misses = 0
    for rate in task.rates:
        run = simulate_run(config, env, sim_policy, lengths, rate)
        attained[rate] = value = run.summary["slo"]["attainment"]
        misses = misses + 1 if value < task.target else 0
        if misses >= MISSES_BEFORE_STOP:
            break
    return attained


def median_attainment(walks: Iterable[dict[float, float]]) -> dict[float, float | None]:
    """Per rate, the median over the walks. A walk that stopped below a rate counts as a miss
    there (it had already fallen below the target twice); None where that miss is the median."""
    walks = list(walks)
    rates = sorted({rate for w in walks for rate in w})
    out: dict[float, float | None] = {}
    for rate in rates:
        value = statistics.median(w.get(rate, -math.inf) for w in walks)
        out[rate] = None if value == -math.inf else value
    return out


def capacity(attained: dict[float, float | None], target: float = CAPACITY_TARGET) -> float | None:
    """The highest rate whose attainment, and that of every lower rate, is at least the target;
    None when the lowest rate already misses. None as an attainment is a miss."""
    best = None
    for rate in sorted(attained):
        value = attained[rate]
        if value is None or value < target:
            break
        best = rate
    return best


def ratio_line(capacities: dict[str, float | None]) -> str:
    """Bullet's capacity over the best baseline's (bullet's own variants are not baselines),
    in words."""
    bullet = capacities.get("bullet")
    baselines = {
        k: v for k, v in capacities.items() if not k.startswith("bullet") and v is not None
    }
    if bullet is None or not baselines:
        return "ratio: undefined (a policy kept the target at no rate of the grid)"
    best = max(baselines, key=lambda k: baselines[k])
    return f"bullet / best baseline ({best}): {bullet / baselines[best]:.2f}x"


def plot(
    grids: dict[str, dict[str, dict[float, float | None]]], hardware: str, target: float, path: Path
) -> Path:
    fig, axes = plt.subplots(1, len(grids), figsize=(6 * len(grids), 4), squeeze=False)
    for ax, (dataset, by_policy) in zip(axes[0], grids.items(), strict=True):
        for label, attained in by_policy.items():
            rates = [r for r in sorted(attained) if attained[r] is not None]
            ax.plot(rates, [100 * attained[r] for r in rates], marker="o", label=label)
        ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(dataset)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%, median over seeds)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    # A profile's path names the device by its file's stem; wrapped, the title stays inside
    # the figure however long the name.
    device = Path(hardware).stem if hardware.endswith(".json") else hardware
    fig.suptitle(f"simulated on {device}: SLO attainment against request rate", wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(
    hardware: str,
    model: str,
    workloads: Sequence[str],
    policies: Sequence[str],
    seeds: Sequence[int],
    num_prompts: int,
    grids: dict[str, tuple[float, ...]],
    target: float = CAPACITY_TARGET,
    workers: int = 1,
    engine: dict[str, Any] | None = None,
) -> dict[str, dict[str, dict[float, float | None]]]:
    """Median attainment per workload, policy and rate. `engine` sets Task's optional fields
    (SLOs, dtype, context length, KV blocks) for every walk."""
    for label in policies:
        policy_settings(label)
    tasks = [
        Task(hardware, model, d, p, s, num_prompts, grids[d], target, **(engine or {}))
        for d in workloads
        for p in policies
        for s in seeds
    ]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            walks = list(pool.map(walk, tasks))
    else:
        walks = [walk(t) for t in tasks]
    out: dict[str, dict[str, dict[float, float | None]]] = {}
    for d in workloads:
        out[d] = {}
        for p in policies:
            mine = [w for t, w in zip(tasks, walks, strict=True) if (t.dataset, t.policy) == (d, p)]
            out[d][p] = median_attainment(mine)
    return out


@dataclasses.dataclass(frozen=True)
class Settings:
    """`bullet simulate capacity`'s settings (its flags: cli/simulate.py)."""

    hardware: str
    model: str
    workloads: str  # comma-separated dataset presets
    policies: str  # comma-separated policy labels
    seeds: str  # comma-separated
    num_prompts: int
    rates: tuple[float, ...] | None  # one grid for every workload; None: per workload
    target: float
    workers: int
    slo: SLO | None  # None: the paper's for each workload
    dtype: str
    quantization: str | None
    tensor_parallel_size: int
    max_model_len: int | None
    num_gpu_blocks_override: int | None
    device_memory_gib: float | None
    max_num_seqs: int
    host_s_per_step: float | None
    host_s_per_row: float | None
    host_overlap: bool
    out: Path | None  # the plot
    results: Path | None  # the attainment grids (JSON)


def main(settings: Settings) -> int:
    """`bullet simulate capacity`: the grids, a table per workload, the plot and the JSON."""
    workloads = [w for w in settings.workloads.split(",") if w]
    unknown = [w for w in workloads if settings.rates is None and w not in CAPACITY_GRIDS]
    if unknown:
        raise SimSetupError(f"--workloads: no default rate grid for {unknown}; give --rates")
    try:
        policies = [p for p in settings.policies.split(",") if p]
        for label in policies:
            policy_settings(label)
        seeds = [int(s) for s in settings.seeds.split(",") if s]
    except ValueError as err:
        raise SimSetupError(f"--policies/--seeds: {err}") from None
    custom_slo = settings.slo
    if custom_slo is None and any(dataset_family(w) is None for w in workloads):
        raise SimSetupError("--workloads: without --slo-* flags, sharegpt, azure or arxiv")
    engine = {
        "slo": custom_slo,
        "dtype": settings.dtype,
        "quantization": settings.quantization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "max_model_len": settings.max_model_len,
        "num_gpu_blocks_override": settings.num_gpu_blocks_override,
        "device_memory_gib": settings.device_memory_gib,
        "max_num_seqs": settings.max_num_seqs,
        "host_s_per_step": settings.host_s_per_step,
        "host_s_per_row": settings.host_s_per_row,
        "host_overlap": settings.host_overlap,
    }
    grids = {w: settings.rates or CAPACITY_GRIDS[w] for w in workloads}
    setup(
        SimConfig(hardware=settings.hardware, model=settings.model, **engine)
    )  # checked once here
    start = time.perf_counter()
    results = run(
        settings.hardware,
        settings.model,
        workloads,
        policies,
        seeds,
        settings.num_prompts,
        grids,
        settings.target,
        settings.workers,
        engine,
    )
    for dataset, by_policy in results.items():
        slo = custom_slo or PAPER_SLOS[dataset_family(dataset) or ""]
        print(
            f"\n### {dataset} (SLO {slo.ttft_base_ms:g} ms + {slo.ttft_per_token_ms:g} ms/token, "
            f"{slo.tpot_ms:g} ms TPOT)\n"
        )
        rates = sorted({r for a in by_policy.values() for r in a})
        head = " | ".join(f"{r:g}" for r in rates)
        print(f"| policy | {head} | capacity at {settings.target:.0%} |")
        print("|---|" + "---:|" * (len(rates) + 1))
        capacities = {}
        for label, attained in by_policy.items():
            capacities[label] = capacity(attained, settings.target)
            cells = ["-" if attained.get(r) is None else f"{100 * attained[r]:.1f}" for r in rates]
            shown = "none" if capacities[label] is None else f"{capacities[label]:g}"
            print(f"| {label} | " + " | ".join(cells) + f" | {shown} |")
        print(f"\n{ratio_line(capacities)}")
    print(
        f"\n(simulated on {settings.hardware}, {settings.model}, {settings.num_prompts} "
        f"requests, seeds {settings.seeds}, in {time.perf_counter() - start:.0f} s)"
    )
    if settings.out:
        print(f"plot: {plot(results, settings.hardware, settings.target, settings.out)}")
    if settings.results:
        payload = {
            "simulated": True,
            "hardware": settings.hardware,
            "model": settings.model,
            "num_prompts": settings.num_prompts,
            "seeds": seeds,
            "target": settings.target,
            "slo": None if custom_slo is None else dataclasses.asdict(custom_slo),
            "dtype": settings.dtype,
            "quantization": settings.quantization,
            "attainment": {
                d: {p: {f"{r:g}": a for r, a in g.items()} for p, g in by_policy.items()}
                for d, by_policy in results.items()
            },
        }
        settings.results.write_text(json.dumps(payload, indent=1) + "\n")
    return 0
