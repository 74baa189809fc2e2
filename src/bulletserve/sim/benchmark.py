"""A simulated benchmark: build the modeled device, the policy and the workload once, then run
the workload at each request rate, as `bullet bench` does against a server."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from bulletserve.bench.classes import WorkloadClass, assign_classes
from bulletserve.bench.datasets import RandomLengths, load_lengths
from bulletserve.bench.load import spec_decode_summary
from bulletserve.bench.records import BenchResult, RunResult
from bulletserve.model.config import ModelConfig
from bulletserve.partition.limits import gpu_min_remainder
from bulletserve.perf.inventory import WEIGHT_FORMAT_BITS
from bulletserve.sched import SchedulerConfig, make_policy
from bulletserve.sched.base import Policy
from bulletserve.sched.bullet import BulletPolicy, UnitSpace
from bulletserve.sched.drafts import DraftRule
from bulletserve.sched.slo import SLO
from bulletserve.sim.device import CachedPerfModel, Noise
from bulletserve.sim.device_presets import (
    GIB,
    GPU_MEMORY_UTILIZATION,
    SimSetupError,
    device_memory,
    kv_cache_blocks,
    load_hardware,
    load_model_config,
)
from bulletserve.sim.laned import LanedSimulator
from bulletserve.sim.one_lane import run_single_lane
from bulletserve.sim.request import SimRequest
from bulletserve.sim.results import run_result
from bulletserve.sim.speculation import AcceptanceTrace, SimSpeculation
from bulletserve.sim.state import SimState
from bulletserve.sim.workload import Lengths, arrivals_for, make_requests, prompt_tokens
from bulletserve.spec.config import SpeculativeConfig
from bulletserve.spec.counters import SpecCounters

DEFAULT_NOISE = 0.02


@dataclass(frozen=True, kw_only=True)
class SimConfig(SchedulerConfig):
    """Everything a simulated benchmark depends on; written into the result as `config`. The
    scheduler's settings (`SchedulerConfig`) are the engine's, with its defaults."""

    hardware: str
    model: str
    dataset: str = "sharegpt-like"
    num_prompts: int = 1000
    request_rates: tuple[float, ...] = (10.0,)
    slo: SLO | None = None
    seed: int = 0
    noise: float = DEFAULT_NOISE
    burstiness: float = 1.0
    trace_arrivals: bool = False
    random_lengths: RandomLengths = field(default_factory=RandomLengths)
    dtype: str = "bfloat16"
    quantization: str | None = None  # a packed format of perf.inventory.WEIGHT_FORMAT_BITS
    tensor_parallel_size: int = 1  # GPUs of one node the model is sharded over
    max_model_len: int | None = None
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    device_memory_gib: float | None = None
    num_gpu_blocks_override: int | None = None
    # The modeled device runs this many times slower than the profile predicts (the policy
    # still believes the profile, and corrects itself online as the engine does).
    device_slowdown: float = 1.0
    # The engine's host time around a step, where the profile's is to be replaced (a GPU
    # preset has none): seconds a step and a sampled row (engine_host_cost.py measures them);
    # and the what-if of that time overlapped with the device's (`sim.device.step_elapsed_s`).
    host_s_per_step: float | None = None
    host_s_per_row: float | None = None
    host_overlap: bool = False
    # A mixed workload (as `bullet bench`'s): its classes, and whether requests ask for their
    # class's priority and SLO (else the run's `slo`).
    service_classes: tuple[WorkloadClass, ...] = ()
    send_priority: bool = False
    send_slo: bool = False
    label: str | None = None
    # Speculative decoding: the engine's settings, and what the proposer did on a real model.
    speculative_config: SpeculativeConfig | None = None
    spec_acceptance: AcceptanceTrace | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.speculative_config is not None:
            spec = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
            if self.spec_acceptance is None:
                raise ValueError(
                    "--speculative-config in the simulator needs --spec-acceptance: what the "
                    "proposer did on a real model (RATE:H1,H2,...)"
                )
        elif self.spec_acceptance is not None:
            raise ValueError("--spec-acceptance without --speculative-config")
        if self.quantization is not None and self.quantization not in WEIGHT_FORMAT_BITS:
            raise ValueError(
                f"--quantization must be one of {', '.join(WEIGHT_FORMAT_BITS)}, not "
                f"{self.quantization!r}"
            )
        for name in ("host_s_per_step", "host_s_per_row"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"the host's time ({name}) must be >= 0, not {value}")
        if self.host_overlap and self.device_slowdown != 1.0:
            raise ValueError(
                "--host-overlap with --device-slowdown: the policy's online corrections learn "
                "from the device's time, which an overlapped host hides"
            )
        if self.send_priority and self.scheduling_policy == "fcfs":
            raise ValueError(
                "--send-priority needs --scheduling-policy priority (a server that schedules "
                "first come first served refuses a request's priority)"
            )


@dataclass
class SimSetup:
    """What the config resolves to: the model, the modeled device, the KV pool size."""

    model: ModelConfig
    perf: CachedPerfModel
    num_blocks: int
    max_model_len: int

    @property
    def hardware_name(self) -> str:
        return self.perf.hw.name


def setup(config: SimConfig) -> SimSetup:
    hw = load_hardware(config.hardware)
    host = {
        name: value
        for name in ("host_s_per_step", "host_s_per_row")
        if (value := getattr(config, name)) is not None
    }
    if host:
        hw = dataclasses.replace(hw, calibration=dataclasses.replace(hw.calibration, **host))
    model = load_model_config(config.model)
    bits = WEIGHT_FORMAT_BITS.get(config.quantization or "")
    try:
        perf = CachedPerfModel(model, hw, config.dtype, config.tensor_parallel_size, bits)
    except ValueError as exc:
        raise SimSetupError(str(exc)) from None
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    else:
        memory_gib = config.device_memory_gib
        memory = device_memory(hw, memory_gib * GIB if memory_gib is not None else None)
        num_blocks = kv_cache_blocks(
            model,
            config.dtype,
            config.block_size,
            memory,
            config.gpu_memory_utilization,
            config.tensor_parallel_size,
            bits,
        )
    max_model_len = config.max_model_len or model.max_position_embeddings
    if num_blocks * config.block_size < max_model_len and config.max_model_len is None:
        max_model_len = num_blocks * config.block_size  # a small pool caps the context
    if num_blocks * config.block_size < max_model_len:
        raise SimSetupError(
            f"the KV pool holds {num_blocks * config.block_size} tokens, fewer than "
            f"--max-model-len {max_model_len}"
        )
    return SimSetup(model, perf, num_blocks, max_model_len)


def make_sim_policy(config: SimConfig, env: SimSetup) -> Policy | BulletPolicy:
    """The policy object the engine would build for this config."""
    hw = env.perf.hw
    # The GPU partitioner's floor on a remainder, as the engine's UnitSpace has it.
    units = UnitSpace(
        hw.units,
        hw.unit_granularity,
        hw.min_units,
        gpu_min_remainder(hw.units) if hw.kind == "gpu" else None,
    )
    spec = config.speculative_config
    drafts = DraftRule.from_perf(env.perf, hw.units) if spec and spec.adaptive else None
    try:
        return make_policy(
            config,
            config.slo,
            env.perf,
            units,
            env.model.num_layers,
            drafts,
            price_drafts=spec is None or spec.adaptive,
        )
    except ValueError as exc:
        raise SimSetupError(str(exc)) from None


def default_label(config: SimConfig) -> str:
    if config.label:
        return config.label
    if config.policy == "chunked":
        return f"chunked-{config.chunk_size}"
    if config.policy == "bullet" and config.partition != "auto":
        return f"bullet-{config.partition}"
    return config.policy


def simulate_run(
    config: SimConfig,
    env: SimSetup,
    policy: Policy | BulletPolicy,
    lengths: Lengths,
    rate: float,
    step_log: TextIO | None = None,
) -> RunResult:
    """One load level on a fresh engine state."""
    arrivals = arrivals_for(lengths, rate, config.burstiness, config.seed, config.trace_arrivals)
    tokens = prompt_tokens(config.dataset, len(lengths), config.seed, config.max_model_len)
    if tokens is not None and [len(t) for t in tokens] != [i for i, _, _ in lengths]:
        raise ValueError(f"{config.dataset}: the lengths were drawn with other settings")
    requests = make_requests(lengths, arrivals, tokens)
    for request in requests:
        request.slo = config.slo  # the server's, as the engine fills it in
    if config.service_classes:
        classes = assign_classes(len(requests), list(config.service_classes), config.seed)
        for request, workload_class in zip(requests, classes, strict=True):
            request.slo_class = workload_class.name
            if config.send_priority:
                request.priority = workload_class.priority
            if config.send_slo:
                request.slo = workload_class.slo
    return simulate_requests(config, env, policy, requests, rate, step_log)


def simulate_requests(
    config: SimConfig,
    env: SimSetup,
    policy: Policy | BulletPolicy,
    requests: list[SimRequest],
    rate: float,
    step_log: TextIO | None = None,
) -> RunResult:
    """Given requests (lengths and arrival times) on a fresh engine state, as a run at `rate`."""
    arrivals = [r.arrival for r in requests]
    state = SimState(
        requests,
        env.num_blocks,
        config.block_size,
        env.max_model_len,
        step_log,
        prefix_caching=config.enable_prefix_caching,
        max_queue_delay_s=(
            None if config.max_queue_delay_ms is None else config.max_queue_delay_ms / 1e3
        ),
    )
    noise = Noise(config.noise, config.seed)
    env.perf.reset_corrections()  # each run starts cold, as a new server does
    slowdown = config.device_slowdown
    if not (slowdown > 0 and math.isfinite(slowdown)):
        raise SimSetupError(f"--device-slowdown must be a positive number, not {slowdown}")
    limits = (config.max_num_seqs, config.max_num_batched_tokens, slowdown)
    speculation = None
    if config.speculative_config is not None and config.spec_acceptance is not None:
        speculation = SimSpeculation(
            config.speculative_config, config.spec_acceptance, config.seed, env.max_model_len
        )
    if isinstance(policy, BulletPolicy):
        end = LanedSimulator(
            state, policy, env.perf, noise, *limits, config.host_overlap, speculation
        ).run()
    else:
        end = run_single_lane(
            state, policy, env.perf, noise, *limits, config.host_overlap, speculation
        )
    if state.book.allocator.num_free != state.book.allocator.num_blocks:
        raise RuntimeError("KV blocks leaked: the pool is not empty after the run")
    duration = max(end, max(arrivals, default=0.0), 1e-9)
    result = run_result(
        requests, rate, config.burstiness, duration, config.slo, config.service_classes
    )
    if speculation is not None:
        result.summary["spec_decode"] = spec_decode_summary(SpecCounters(), speculation.counters)
    return result


def simulate(
    config: SimConfig,
    step_log: Path | None = None,
    on_run: Callable[[RunResult], None] | None = None,
) -> BenchResult:
    """The whole sweep, as a bench result marked simulated on the modeled hardware."""
    env = setup(config)
    policy = make_sim_policy(config, env)
    max_len = config.max_model_len
    lengths = load_lengths(
        config.dataset, config.num_prompts, config.seed, max_len, config.random_lengths
    )
    runs = []
    for rate in config.request_rates:
        with _step_log(step_log, rate, len(config.request_rates)) as log:
            run = simulate_run(config, env, policy, lengths, rate, log)
        runs.append(run)
        if on_run:
            on_run(run)
    settings = asdict(config)
    if config.speculative_config is not None:
        settings["speculative_config"] = config.speculative_config.to_dict()
    settings.update(
        simulated=True,
        hardware_profile=env.hardware_name,
        kv_cache_blocks=env.num_blocks,
        max_model_len=env.max_model_len,
        model_parameters=env.model.num_parameters(),
    )
    return BenchResult(
        label=default_label(config),
        config=settings,
        runs=runs,
        simulated=True,
        hardware=env.hardware_name,
    )


def step_log_path(path: Path, rate: float, num_rates: int) -> Path:
    """One step log per rate in a sweep: NAME-rate<R>.EXT beside PATH."""
    if num_rates == 1:
        return path
    name = "inf" if math.isinf(rate) else f"{rate:g}"
    return path.with_name(f"{path.stem}-rate{name}{path.suffix}")


@contextlib.contextmanager
def _step_log(path: Path | None, rate: float, num_rates: int) -> Iterator[TextIO | None]:
    if path is None:
        yield None
        return
    target = step_log_path(path, rate, num_rates)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w") as handle:
        yield handle
