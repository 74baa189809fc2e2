"""Simulator fidelity: simulate measured `bullet bench` runs on the measured hardware profile
and print mean TTFT, mean TPOT, throughput and SLO attainment side by side: the first three
differ by a ratio (target 15%), attainment by points (target 0.1).

bullet simulate fidelity --profile PROFILE.json --model smollm2-135m SWEEP/*.json [--out-dir DIR]

Each measured run is replayed request for request: the same prompt lengths, output lengths (as
measured, so early stops count) and arrival times, at the same SLOs. The policy comes from the
result's label (`bullet...`, `chunked-N`, `prefill-first`) unless --policy says otherwise.
Engine settings default to `bullet serve`'s; the KV pool is unbounded unless
--num-gpu-blocks-override gives the server's.

--profile-per-run: replay each run on the quick profile taken right before it
(`benchmarks/bench_lanes_cpu.py --interleave --profile-each-run`), so that the machine's speed of
the moment, which swung 2x within half an hour, is not counted against the simulator.

--served-speed (a diagnostic, not the fidelity test): scale each run's predicted steps, per
phase, by the median measured / predicted ratio of that run's own served steps (its lines of
LABEL.steps.jsonl beside the result, re-predicted from the state each line records on the run's
profile), and for a single-lane engine take the host's time between steps from the same log.
The machine's speed during the run is then given rather than predicted; what is left to differ
is the simulator's scheduling, batching and queueing.

--group: the files are repeats of the same sweeps (several runs of each label, e.g. the same
configuration from different days); each figure is then the median over the runs that have its
rate, measured and simulated, beside the measured runs' own spread (largest over smallest, -1):
a difference inside that spread is one this machine cannot resolve.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bulletserve.bench.records import BenchResult, RunResult, load_result
from bulletserve.bookkeeping.record import StepRecord, read_step_log
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.model import StepPrediction
from bulletserve.sched.slo import SLO
from bulletserve.sim.benchmark import (
    SimConfig,
    make_sim_policy,
    setup,
    simulate_requests,
)
from bulletserve.sim.device import CachedPerfModel
from bulletserve.sim.device_presets import SimSetupError
from bulletserve.sim.request import SimRequest

TARGET = 0.15  # relative, for the latency and throughput figures
ATTAINMENT_TARGET = 0.1  # absolute, for SLO attainment (a fraction of the requests)


@dataclass(frozen=True)
class Metric:
    name: str
    path: tuple[str, ...]
    # An attainment differs by points (simulated minus measured); the rest by ratio.
    absolute: bool = False

    def difference(self, measured: float, simulated: float) -> float:
        return simulated - measured if self.absolute else simulated / measured - 1

    def missed_by(self, difference: float) -> float:
        """The difference in units of its target: above 1 is a miss."""
        return abs(difference) / (ATTAINMENT_TARGET if self.absolute else TARGET)

    def show(self, value: float) -> str:
        return f"{value:.3f}" if self.absolute else f"{value:.1f}"

    def show_difference(self, difference: float) -> str:
        return f"{difference:+.3f}" if self.absolute else f"{difference:+.1%}"


METRICS = (
    Metric("mean TTFT ms", ("ttft_ms", "mean")),
    Metric("mean TPOT ms", ("tpot_ms", "mean")),
    Metric("out tok/s", ("output_throughput",)),
    Metric("SLO attainment", ("slo", "attainment"), absolute=True),
)


def policy_of(label: str) -> tuple[str, int | None]:
    """(policy, chunk size) from a result label such as bullet, chunked-1024, prefill-first."""
    name = label.split()[0].lower()
    if name.startswith("bullet"):
        return "bullet", None
    if name.startswith("prefill-first"):
        return "prefill-first", None
    if name.startswith("chunked"):
        size = name.removeprefix("chunked").strip("-_")
        return "chunked", int(size) if size.isdigit() else None
    raise ValueError(f"cannot tell the policy from the label {label!r}: pass --policy")


NO_FUSE = "-no-fuse"  # a label's suffix for bullet with --no-fuse-decode


def fuses_decode(label: str) -> bool:
    """Whether the run a label names let bullet fuse decode rows (`bullet-no-fuse`: no)."""
    return not label.split()[0].lower().endswith(NO_FUSE)


def partition_of(label: str) -> str:
    """The bullet partition a result label names: `bullet` auto, `bullet-partition-none` (or
    `bullet-none`) none, `bullet-static-1-1` (or `bullet-static:1/1`) static:1/1; a
    `-no-fuse` suffix does not change it."""
    name = label.split()[0].lower().removesuffix(NO_FUSE)
    if not name.startswith("bullet"):
        return "auto"
    rest = name.removeprefix("bullet").strip("-_").removeprefix("partition-")
    if rest in ("", "auto", "none"):
        return rest or "auto"
    static = re.fullmatch(r"static[-:](\d+)[-/](\d+)", rest)
    if static is None:
        raise ValueError(f"cannot tell the partition from the label {label!r}")
    return f"static:{static[1]}/{static[2]}"


def replay(run: RunResult) -> list[SimRequest]:
    """The measured run's requests: lengths as measured and arrival offsets as sent."""
    return [
        SimRequest(
            f"req-{r.index}",
            r.index,
            r.start_s,
            r.input_len,
            r.output_len if r.success and r.output_len > 0 else r.max_tokens,
        )
        for r in run.requests
    ]


def run_slo(run: RunResult) -> SLO | None:
    slo = run.summary.get("slo")
    if not slo:
        return None
    return SLO(slo["ttft_per_token_ms"], slo["tpot_ms"], slo.get("ttft_base_ms", 0.0))


def _value(summary: dict, path: tuple[str, ...]) -> float | None:
    value = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def compare(measured: RunResult, simulated: RunResult) -> list[tuple[Metric, float, float, float]]:
    """(metric, measured, simulated, difference) for each figure both runs have."""
    rows = []
    for metric in METRICS:
        m, s = _value(measured.summary, metric.path), _value(simulated.summary, metric.path)
        if m is None or s is None or (m == 0 and not metric.absolute):
            continue
        rows.append((metric, m, s, metric.difference(m, s)))
    return rows


# A served sweep's step log holds every run of one configuration: a gap this long between steps
# separates two runs, and a segment of fewer steps is the server's warm-up request.
RUN_GAP_S = 10.0
MIN_RUN_STEPS = 100


def runs_of(step_log: Path) -> list[list[StepRecord]]:
    """The step log's records split at idle gaps; segments too short to be a run dropped."""
    try:
        steps = sorted(read_step_log(step_log), key=lambda s: s.time)
    except ValueError as exc:
        raise SimSetupError(str(exc)) from None
    segments: list[list[StepRecord]] = [[]]
    for step in steps:
        if segments[-1] and step.time - segments[-1][-1].time > RUN_GAP_S:
            segments.append([])
        segments[-1].append(step)
    return [s for s in segments if len(s) >= MIN_RUN_STEPS]


@dataclass(frozen=True)
class ServedSpeed:
    """How fast a served run went, from its step log: per phase, the median measured /
    predicted step; for a single-lane engine, also the host's time between its steps beyond
    what the profile's sampler takes, fitted as seconds per step + seconds per row."""

    factors: dict[str, float]
    host: tuple[float, float] | None = None


class ScaledPerfModel(CachedPerfModel):
    """Diagnostic: every predicted step of a phase `speed.factors[phase]` times the profile's,
    and the host's time per step the served one where it was measured."""

    def __init__(self, perf: CachedPerfModel, speed: ServedSpeed) -> None:
        super().__init__(perf.cfg, perf.hw, perf.dtype)
        self.speed = speed

    def uncorrected(self, es: ExecutionState) -> StepPrediction:
        base = super().uncorrected(es)
        return StepPrediction(
            prefill_s=base.prefill_s * self.speed.factors["prefill"],
            decode_s=base.decode_s * self.speed.factors["decode"],
        )

    def host_s(self, rows: int) -> float:
        if self.speed.host is None:
            return super().host_s(rows)
        per_step, per_row = self.speed.host
        return per_step + per_row * rows


# Between two steps of a busy single-lane engine the host samples, streams and plans; a longer
# pause is the engine waiting for requests.
BUSY_GAP_S = 0.1


def served_speed(steps: list[StepRecord], perf: CachedPerfModel) -> ServedSpeed:
    """A served run's speed from its step-log lines, each re-predicted from its state: per
    phase (a decode step; a prefill, layer group or fused chunked step) the median measured /
    predicted; for a single-lane engine's log, the host's time between busy steps less the
    profile's sampler (which the prediction of a step includes), fitted over the batch."""
    ratios: dict[str, list[float]] = defaultdict(list)
    host_by_rows: dict[int, list[float]] = defaultdict(list)
    steps = sorted(steps, key=lambda step: step.time)
    for step, following in zip(steps, [*steps[1:], None], strict=True):
        es = step.state
        prediction = perf.predict(es)
        phase = "decode" if step.lane == "decode" else "prefill"
        predicted = prediction.decode_s if phase == "decode" else prediction.prefill_s
        if predicted > 0:
            ratios[phase].append(step.measured_s / predicted)
        if step.rule is not None or following is None:
            continue  # the lanes' steps overlap: no host gap to read
        gap = following.started - step.time
        if 0 <= gap < BUSY_GAP_S:
            host_by_rows[step.batch_size].append(gap - perf.sampling_s(es, phase))
    factors = {phase: statistics.median(ratios[phase] or [1.0]) for phase in ("prefill", "decode")}
    # The median gap per batch size: a short wait for the next request (the engine idle, not
    # busy on the host) is an outlier there.
    medians = {count: statistics.median(v) for count, v in host_by_rows.items() if len(v) >= 3}
    if len(medians) < 2:
        return ServedSpeed(factors)
    per_row, per_step = (float(c) for c in np.polyfit(list(medians), list(medians.values()), 1))
    return ServedSpeed(factors, (max(per_step, 0.0), max(per_row, 0.0)))


def run_profile(path: Path, label: str, rate: float) -> str:
    """The profile taken right before the run of `label` at `rate` (`benchmarks/bench_lanes_cpu.py
    --profile-each-run`), beside the measured result file."""
    for candidate in path.parent.glob(f"{label}.rate-*.profile.json"):
        text = candidate.name.removeprefix(f"{label}.rate-").removesuffix(".profile.json")
        if float(text) == rate:
            return str(candidate)
    raise FileNotFoundError(f"no {label}.rate-{rate:g}.profile.json beside {path}")


def simulate_like(
    result: BenchResult,
    base: SimConfig,
    policy: str | None,
    path: Path | None = None,
    speed_from: Path | None = None,
) -> BenchResult:
    """The measured result replayed run by run; with `path` (the result's file), each run on
    the profile taken right before it; with `speed_from` (the result's file), at the served
    run's own speed (see --served-speed)."""
    name, chunk = (policy, base.chunked_prefill_size) if policy else policy_of(result.label)
    served_steps: dict[float, list[dict]] = {}
    if speed_from is not None:
        # A label's step log holds its runs in the order their rates ran, ascending.
        rates = sorted(run.request_rate for run in result.runs)
        logged = runs_of(speed_from.parent / f"{result.label}.steps.jsonl")
        if len(logged) != len(rates):
            raise SimSetupError(f"{speed_from}: {len(rates)} runs, {len(logged)} in its step log")
        served_steps = dict(zip(rates, logged, strict=True))
    runs = []
    for run in result.runs:
        config = replace(
            base,
            hardware=run_profile(path, result.label, run.request_rate) if path else base.hardware,
            policy=name,
            chunked_prefill_size=chunk or base.chunked_prefill_size,
            request_rates=(run.request_rate,),
            slo=run_slo(run) or base.slo,
            label=f"{result.label} (replayed)",
        )
        if name == "bullet":
            config = replace(
                config, partition=partition_of(result.label), fuse_decode=fuses_decode(result.label)
            )
        requests = replay(run)
        if config.num_gpu_blocks_override is None:
            tokens = sum(r.input_len + r.output_len for r in requests)
            config = replace(
                config, num_gpu_blocks_override=tokens // config.block_size + len(requests) + 1
            )
        env = setup(config)
        if served_steps:
            speed = served_speed(served_steps[run.request_rate], env.perf)
            host = (
                f"; host between steps {speed.host[0] * 1e3:.2f} ms + "
                f"{speed.host[1] * 1e3:.3f} ms a row (profile {env.perf.host_s(0) * 1e3:.2f} + "
                f"{(env.perf.host_s(1) - env.perf.host_s(0)) * 1e3:.3f})"
                if speed.host
                else ""
            )
            print(
                f"{result.label} at {run.request_rate:g} req/s: served / predicted steps, "
                f"prefill {speed.factors['prefill']:.2f}, decode {speed.factors['decode']:.2f}"
                + host
            )
            env = replace(env, perf=ScaledPerfModel(env.perf, speed))
        runs.append(
            simulate_requests(config, env, make_sim_policy(config, env), requests, run.request_rate)
        )
    profiles = (
        sorted({run_profile(path, result.label, r.request_rate) for r in result.runs})
        if path
        else base.hardware
    )
    return BenchResult(
        label=f"{result.label} (replayed)",
        config={"measured": result.label, "profile": profiles, "model": base.model},
        runs=runs,
        simulated=True,
        hardware=env.hardware_name,
    )


def isolated_table(path: Path, profile: str, model: str, dtype: str) -> None:
    """Measured latencies of requests sent one at a time (`benchmarks/bench_lanes_cpu.py`'s
    isolated.json) beside the profile's predictions: TTFT against a lone prefill on every
    unit, the median TPOT against a batch-1 decode."""
    from bulletserve.model.presets import get_preset
    from bulletserve.perf.hardware import HardwareProfile
    from bulletserve.perf.model import PerfModel

    hw = HardwareProfile.load(profile)
    perf = PerfModel(get_preset(model), hw, dtype)
    data = json.loads(path.read_text())
    print("| prompt tokens | measured TTFT ms | predicted ms | difference |")
    print("|---|---|---|---|")
    gaps = []
    for (tokens, _), per_token in zip(data["requests"], data["ttft_per_token_ms_all"], strict=True):
        es = ExecutionState(prefill_lens=(tokens,), prefill_units=hw.units)
        predicted = perf.predict(es).prefill_s * 1e3
        measured = per_token * tokens
        gaps.append(measured - predicted)
        print(f"| {tokens} | {measured:.1f} | {predicted:.1f} | {measured - predicted:+.1f} ms |")
    contexts = sorted(tokens for tokens, _ in data["requests"])
    es = ExecutionState(decode_ctx=(contexts[len(contexts) // 2],), decode_units=hw.units)
    decode = perf.predict(es).decode_s * 1e3
    print(
        f"\nTTFT: measured minus predicted, median {sorted(gaps)[len(gaps) // 2]:+.1f} ms; "
        f"TPOT: measured {data['tpot_ms']:.1f} ms, batch-1 decode predicted {decode:.1f} ms "
        f"({data['tpot_ms'] / decode - 1:+.1%})"
    )


def per_run_table(
    paths: list[Path],
    base: SimConfig,
    policy: str | None,
    out_dir: Path | None,
    profile_per_run: bool = False,
    speed: bool = False,
) -> float:
    """Each measured run beside its replay; returns the largest difference."""
    print("| measured run | rate | metric | measured | simulated | difference |")
    print("|---|---|---|---|---|---|")
    worst, misses, figures = 0.0, 0, 0
    for path in paths:
        result = load_result(path)
        simulated = simulate_like(
            result,
            base,
            policy,
            path if profile_per_run else None,
            path if speed else None,
        )
        if out_dir:
            out_dir.mkdir(parents=True, exist_ok=True)
            simulated.save(out_dir / f"sim-{path.name}")
        for measured_run, sim_run in zip(result.runs, simulated.runs, strict=True):
            for metric, m, s, diff in compare(measured_run, sim_run):
                worst = max(worst, metric.missed_by(diff))
                figures += 1
                misses += metric.missed_by(diff) > 1
                flag = "" if metric.missed_by(diff) <= 1 else " **"
                print(
                    f"| {result.label} | {measured_run.request_rate:g} | {metric.name} | "
                    f"{metric.show(m)} | {metric.show(s)} | {metric.show_difference(diff)}{flag} |"
                )
    print(f"\n{misses} of {figures} figures differ by more than their target\n")
    return worst


def grouped_table(paths: list[Path], base: SimConfig, policy: str | None) -> float:
    """The --group comparison; returns the largest difference of medians."""
    # (label, rate, metric) -> measured values, simulated values
    figures: dict[tuple[str, float, Metric], tuple[list[float], list[float]]] = defaultdict(
        lambda: ([], [])
    )
    for path in paths:
        result = load_result(path)
        label = result.label.split()[0]
        simulated = simulate_like(result, base, policy)
        for measured_run, sim_run in zip(result.runs, simulated.runs, strict=True):
            for metric, m, s, _ in compare(measured_run, sim_run):
                measured, sims = figures[(label, measured_run.request_rate, metric)]
                measured.append(m)
                sims.append(s)
    print("| config | rate | metric | measured (median of n) | spread | simulated | difference |")
    print("|---|---|---|---|---|---|---|")
    worst, misses, unresolved = 0.0, 0, 0
    order = {metric: i for i, metric in enumerate(METRICS)}
    for (label, rate, metric), (measured, sims) in sorted(
        figures.items(), key=lambda item: (item[0][0], item[0][1], order[item[0][2]])
    ):
        m, s = statistics.median(measured), statistics.median(sims)
        # The spread in the metric's own terms: points for attainment, a ratio otherwise.
        if metric.absolute:
            spread = max(measured) - min(measured)
            shown_spread = f"{spread:.3f}"
        else:
            spread = max(measured) / min(measured) - 1 if min(measured) > 0 else float("inf")
            shown_spread = f"{spread:.0%}"
        diff = metric.difference(m, s)
        worst = max(worst, metric.missed_by(diff))
        flag = ""
        if metric.missed_by(diff) > 1:
            misses += 1
            flag = " **"
            if abs(diff) <= spread:
                unresolved += 1
                flag = " * (within the spread)"
        print(
            f"| {label} | {rate:g} | {metric.name} | {metric.show(m)} ({len(measured)}) | "
            f"{shown_spread} | {metric.show(s)} | {metric.show_difference(diff)}{flag} |"
        )
    print(
        f"\n{misses} of {len(figures)} figures differ by more than their target, {unresolved} of "
        "them by less than the measured runs' own spread"
    )
    return worst


@dataclasses.dataclass(frozen=True)
class Settings:
    """`bullet simulate fidelity`'s settings (its flags: cli/simulate.py)."""

    measured: list[Path]  # bullet bench result files
    profile: str | None
    profile_per_run: bool
    model: str
    policy: str | None
    chunked_prefill_size: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks_override: int | None
    dtype: str
    noise: float
    out_dir: Path | None
    served_speed: bool
    group: bool
    isolated: Path | None


def main(settings: Settings) -> int:
    """`bullet simulate fidelity`: the tables; exit status 1 where a figure misses its target."""
    if settings.profile_per_run:
        if settings.profile or settings.group or settings.isolated:
            raise SimSetupError("--profile-per-run takes no --profile, --group or --isolated")
    elif not settings.profile:
        raise SimSetupError("--profile is required (or --profile-per-run)")
    if settings.served_speed and settings.group:
        raise SimSetupError("--served-speed takes no --group")
    if settings.isolated:
        isolated_table(settings.isolated, settings.profile, settings.model, settings.dtype)
        print()
    base = SimConfig(
        hardware=settings.profile,
        model=settings.model,
        chunked_prefill_size=settings.chunked_prefill_size,
        dtype=settings.dtype,
        noise=settings.noise,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        num_gpu_blocks_override=settings.num_gpu_blocks_override,
    )
    if settings.group:
        worst = grouped_table(settings.measured, base, settings.policy)
    else:
        worst = per_run_table(
            settings.measured,
            base,
            settings.policy,
            settings.out_dir,
            settings.profile_per_run,
            settings.served_speed,
        )
    print(
        f"largest difference {worst:.2f}x its target (targets: {TARGET:.0%} for latency and "
        f"throughput, {ATTAINMENT_TARGET} for SLO attainment; ** marks misses)"
    )
    return 0 if worst <= 1 else 1
