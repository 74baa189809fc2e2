"""`bullet simulate`: the serving policies on a modeled device (a discrete-event simulation).

bullet simulate --hardware a100-80g --model llama-3.1-8b --policy bullet \\
    --dataset sharegpt-like --num-prompts 1000 --request-rates 10,15,20,25 --output sim.json
bullet simulate capacity --hardware h200 --workloads sharegpt-like --out capacity.png
bullet simulate fidelity --profile PROFILE.json SWEEP/*.json
bullet simulate paper --out docs

The result file has `bullet bench`'s schema, marked simulated with the hardware profile, so
`bullet bench compare` and `bullet bench plot` take simulated and measured runs alike.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from bulletserve.cli import CLIError, settings_of
from bulletserve.cli.bench import add_service_class_args, add_slo_args, service_classes
from bulletserve.engine.config import add_scheduler_args, policy_of
from bulletserve.perf.inventory import WEIGHT_FORMAT_BITS
from bulletserve.sched import SchedulerConfig
from bulletserve.sim.defaults import (
    CAPACITY_GRIDS,
    CAPACITY_POLICIES,
    CAPACITY_TARGET,
    DEFAULT_NOISE,
    PAPER_WORKLOADS,
)


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    parser = subparsers.add_parser(
        name,
        help="simulate a serving policy on a modeled GPU (or a profiled CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.set_defaults(run=run)
    device = parser.add_argument_group("modeled device and model")
    _add_device_args(device)
    device.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of device memory for weights and KV cache (vLLM's)",
    )
    device.add_argument(
        "--device-slowdown",
        type=float,
        default=1.0,
        help="the modeled device runs this many times slower than the profile predicts, while "
        "the policy believes the profile and corrects itself online",
    )

    engine = parser.add_argument_group("engine (the flags and defaults of bullet serve)")
    add_scheduler_args(parser, engine)

    data = parser.add_argument_group("workload (as bullet bench)")
    data.add_argument(
        "--dataset",
        default="sharegpt-like",
        help="sharegpt-like, azure-code-like, arxiv-sum-like, random, shared-prefix, multi-turn "
        "or azure:PATH",
    )
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--input-len", type=int, default=1024, help="random: input tokens")
    data.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    data.add_argument("--range-ratio", type=float, default=0.0, help="random: length spread")
    data.add_argument("--request-rate", default="inf", help="mean requests/s, or inf")
    data.add_argument("--request-rates", metavar="R1,R2,...", help="a sweep, e.g. 10,15,20,25")
    data.add_argument("--burstiness", type=float, default=1.0)
    data.add_argument("--trace-arrivals", action="store_true", help="azure: the trace's times")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument(
        "--noise",
        type=float,
        default=DEFAULT_NOISE,
        help="log-normal sigma of per-step time noise (0: exact predictions)",
    )
    slo = parser.add_argument_group("SLOs (default: the paper's for the dataset)")
    add_slo_args(slo)
    add_service_class_args(slo)

    out = parser.add_argument_group("output")
    out.add_argument("--label", help="name of this run in tables and plots")
    out.add_argument("--output", type=Path, metavar="RESULT.json")
    out.add_argument("--plot", type=Path, metavar="DIR")
    out.add_argument(
        "--step-log",
        type=Path,
        metavar="PATH",
        help="one JSON line per simulated step (a sweep writes PATH-rate<R> per rate)",
    )
    _add_studies(parser.add_subparsers(dest="study", metavar="{capacity,fidelity,paper}"))


def _add_device_args(
    group: argparse._ActionsContainer, hardware: str | None = None, model: str | None = None
) -> None:
    """The modeled device and model, as `bullet simulate` and its capacity study take them."""
    group.add_argument(
        "--hardware",
        default=hardware,
        metavar="NAME|PATH",
        help="a100-80g, h100, h200, h20 (datasheet presets) or a `bullet profile` JSON",
    )
    group.add_argument(
        "--model",
        default=model,
        metavar="PRESET|PATH",
        help="a model preset "
        "(llama-3.1-8b, llama-3.1-70b, qwen3-8b, smollm2-135m, tiny) or config.json",
    )
    group.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    group.add_argument(
        "--quantization",
        default=None,
        choices=tuple(WEIGHT_FORMAT_BITS),
        help="the GEMMs' weights in this packed GGUF format (its bits a weight, scales "
        "included: Q4_K 4.5, Q8_0 8.5, ...): fewer bytes a step reads and the weights hold in "
        "memory; the FLOPs stay (default: weights in --dtype)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="GPUs of one node the model is sharded over (all-reduce times from the profile)",
    )
    group.add_argument("--max-model-len", type=int, help="(default: the model's)")
    group.add_argument(
        "--device-memory-gib", type=float, help="device memory (default: the preset's datasheet)"
    )
    group.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks, exactly")
    group.add_argument(
        "--host-ms-per-step",
        type=float,
        help="the engine's host time a step (default: the profile's; a GPU preset has none)",
    )
    group.add_argument(
        "--host-us-per-row",
        type=float,
        help="the engine's host time a sampled row (default: the profile's; "
        "benchmarks/engine_host_cost.py measures a host's)",
    )
    group.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="speculative decoding as the engine's flag sets it (one-lane policies); needs "
        "--spec-acceptance",
    )
    group.add_argument(
        "--spec-acceptance",
        metavar="RATE:H1,H2,...",
        help="what the proposer did on a real model: the share of decode rows it drafted for, "
        "and each draft position's chance to hold given the one before did "
        "(bench_spec_decode.py prints a run's)",
    )
    group.add_argument(
        "--host-overlap",
        action="store_true",
        help="what-if: the host's time overlapped with the device's (a step takes the longer "
        "of the two, not their sum), as an engine that plans a step while the last one runs",
    )


def _add_studies(studies: argparse._SubParsersAction) -> None:
    capacity = studies.add_parser(
        "capacity",
        help="the highest rate each policy serves at an SLO attainment target",
        description="For each workload and policy, the highest Poisson rate that keeps SLO "
        "attainment at the target, and Bullet's over the best baseline's. Each (workload, "
        "policy, seed) walks its rate grid upwards and stops after two rates in a row below "
        "the target; a rate's attainment is the median over the seeds; a rate counts only if "
        "every rate below it kept the target.",
    )
    _add_device_args(capacity, hardware="a100-80g", model="llama-3.1-8b")
    capacity.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="running requests at most, for every policy (as bullet serve; vLLM's on a GPU of "
        "70 GiB or more other than an A100 is 1024)",
    )
    capacity.add_argument(
        "--workloads", default=",".join(CAPACITY_GRIDS), help="dataset presets, comma-separated"
    )
    capacity.add_argument(
        "--policies",
        default=",".join(CAPACITY_POLICIES),
        help="comma-separated: bullet, chunked-N (N-token chunks), prefill-first, and "
        "bullet-without-RULE[+RULE] ablations",
    )
    capacity.add_argument("--seeds", default="0,1,2", help="a rate's attainment is their median")
    capacity.add_argument("--num-prompts", type=int, default=1000, help="requests per run")
    capacity.add_argument(
        "--rates",
        type=_positive_rates,
        metavar="R1,R2,...",
        help="one grid for every workload (default: per workload)",
    )
    capacity.add_argument("--target", type=float, default=CAPACITY_TARGET, help="attainment")
    add_slo_args(capacity.add_argument_group("SLOs (default: the paper's for the workload)"))
    capacity.add_argument("--workers", type=int, default=1, help="processes running simulations")
    capacity.add_argument("--out", type=Path, help="the plot (PNG)")
    capacity.add_argument("--results", type=Path, help="the attainment grids (JSON)")

    fidelity = studies.add_parser(
        "fidelity",
        help="measured bullet bench runs against their simulation on the measured profile",
        description="Replays measured `bullet bench` runs request for request (lengths as "
        "measured, arrival times, SLOs) on the device's profile and prints mean TTFT, mean "
        "TPOT and throughput (target: within 15%%) and SLO attainment (within 0.1) side by "
        "side. Exit status 1 where a figure misses. docs/simulation.md explains each flag.",
    )
    fidelity.add_argument("measured", nargs="+", type=Path, help="bullet bench result files")
    fidelity.add_argument("--profile", help="the `bullet profile` JSON of the device")
    fidelity.add_argument(
        "--profile-per-run",
        action="store_true",
        help="replay each run on the profile taken right before it (LABEL.rate-R.profile.json "
        "beside the result file: benchmarks/bench_lanes_cpu.py --profile-each-run)",
    )
    fidelity.add_argument("--model", default="smollm2-135m", help="model preset or config.json")
    fidelity.add_argument("--policy", help="the served policy, when labels do not say")
    fidelity.add_argument("--chunked-prefill-size", type=int)
    fidelity.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    fidelity.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    fidelity.add_argument("--num-gpu-blocks-override", type=int)
    fidelity.add_argument("--dtype", default="bfloat16")
    fidelity.add_argument("--noise", type=float, default=DEFAULT_NOISE)
    fidelity.add_argument("--out-dir", type=Path, help="save the simulated results here")
    fidelity.add_argument(
        "--served-speed",
        action="store_true",
        help="diagnostic: each run at its own served steps' measured / predicted speed per "
        "phase, and host time between steps from its step log",
    )
    fidelity.add_argument(
        "--group",
        action="store_true",
        help="the files repeat the same sweeps: medians per label and rate, beside the "
        "measured runs' own spread",
    )
    fidelity.add_argument(
        "--isolated",
        type=Path,
        help="also compare the isolated latencies of this isolated.json with the profile",
    )

    paper = studies.add_parser(
        "paper",
        help="the Bullet paper's setting: A100-80GB, Llama-3.1-8B, its three workloads",
        description="A100-80GB, Llama-3.1-8B, three workloads at Poisson 10 to 25 req/s, the "
        "paper's SLOs; Bullet against chunked prefill (1024 and 2048) and prefill-first. "
        "Prints markdown tables and writes one plot per workload.",
    )
    paper.add_argument("--out", type=Path, required=True, help="folder for sim-WORKLOAD.png")
    paper.add_argument("--results", type=Path, help="also save each result JSON here")
    paper.add_argument("--num-prompts", type=int, default=1000)
    paper.add_argument("--workloads", default=",".join(PAPER_WORKLOADS))


def _host_settings(args: argparse.Namespace) -> dict[str, float | bool | None]:
    """The `--host-*` flags as SimConfig's fields (seconds)."""
    return {
        "host_s_per_step": None if args.host_ms_per_step is None else args.host_ms_per_step / 1e3,
        "host_s_per_row": None if args.host_us_per_row is None else args.host_us_per_row / 1e6,
        "host_overlap": args.host_overlap,
    }


def _positive_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(sorted(float(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 2,2.5,3; got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive; got {text!r}")
    return rates


def _run_study(args: argparse.Namespace) -> int:
    import importlib

    from bulletserve.sched.slo import SLO
    from bulletserve.sim.device_presets import SimSetupError

    values: dict[str, object] = {}  # settings that are not one flag each
    if args.study == "capacity":
        if (args.slo_ttft_per_token_ms is None) != (args.slo_tpot_ms is None):
            raise CLIError("--slo-ttft-per-token-ms and --slo-tpot-ms go together")
        slo = None
        if args.slo_tpot_ms is not None:
            slo = SLO(args.slo_ttft_per_token_ms, args.slo_tpot_ms, args.slo_ttft_base_ms)
        values = {"slo": slo, **_host_settings(args)}
    study = importlib.import_module(f"bulletserve.sim.{args.study}")
    try:
        return study.main(settings_of(study.Settings, args, **values))
    except (SimSetupError, FileNotFoundError) as exc:
        raise CLIError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from bulletserve.bench.datasets import DatasetError, RandomLengths
    from bulletserve.bench.report import summary_table
    from bulletserve.cli.bench import _rates, _slo
    from bulletserve.sim.benchmark import SimConfig, simulate
    from bulletserve.sim.device_presets import SimSetupError
    from bulletserve.sim.speculation import AcceptanceTrace

    if args.study:
        return _run_study(args)
    if args.hardware is None or args.model is None:
        raise CLIError("--hardware and --model are required")
    if args.num_prompts < 1 or args.tensor_parallel_size < 1:
        raise CLIError("--num-prompts and --tensor-parallel-size must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise CLIError("--max-model-len must be at least 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise CLIError("--gpu-memory-utilization must be in (0, 1]")
    if args.burstiness <= 0 or args.noise < 0:
        raise CLIError("--burstiness must be positive and --noise at least 0")
    scheduler = {f.name: getattr(args, f.name) for f in fields(SchedulerConfig)}
    try:
        scheduler["policy"] = policy_of(args)
        config = SimConfig(
            **scheduler,
            hardware=args.hardware,
            model=args.model,
            dataset=args.dataset,
            num_prompts=args.num_prompts,
            request_rates=_rates(args),
            slo=_slo(args),
            seed=args.seed,
            noise=args.noise,
            burstiness=args.burstiness,
            trace_arrivals=args.trace_arrivals,
            random_lengths=RandomLengths(args.input_len, args.output_len, args.range_ratio),
            dtype=args.dtype,
            quantization=args.quantization,
            tensor_parallel_size=args.tensor_parallel_size,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            device_memory_gib=args.device_memory_gib,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            device_slowdown=args.device_slowdown,
            **_host_settings(args),
            service_classes=service_classes(args),
            send_priority=args.send_priority,
            send_slo=args.send_slo,
            label=args.label,
            speculative_config=args.speculative_config,
            spec_acceptance=(
                None
                if args.spec_acceptance is None
                else AcceptanceTrace.parse(args.spec_acceptance)
            ),
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        result = simulate(
            config,
            args.step_log,
            on_run=lambda run: print(summary_table(run, simulated=True), flush=True),
        )
    except (SimSetupError, DatasetError) as exc:
        raise CLIError(str(exc)) from None
    print(f"simulated on {result.hardware}: {result.label}")
    if args.output:
        result.save(args.output)
        print(f"results: {args.output}")
    if args.plot:
        from bulletserve.bench.plots import plot_results

        plot_results([result], args.plot)
        print(f"plots: {args.plot}/")
    return 0
