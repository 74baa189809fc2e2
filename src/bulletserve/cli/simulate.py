"""`bullet simulate`: the serving policies on a modeled device (a discrete-event simulation).

bullet simulate --hardware a100-80g --model llama-3.1-8b --policy bullet \\
    --dataset sharegpt-like --num-prompts 1000 --request-rates 10,15,20,25 --output sim.json

The result file has `bullet bench`'s schema, marked simulated with the hardware profile, so
`bullet bench compare` and `bullet bench plot` take simulated and measured runs alike.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from bulletserve.cli import CLIError
from bulletserve.engine.config import add_scheduler_args, policy_of
from bulletserve.sched import SchedulerConfig


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
    device.add_argument(
        "--hardware",
        required=True,
        metavar="NAME|PATH",
        help="a100-80g, h100, h200, h20 (datasheet presets) or a `bullet profile` JSON",
    )
    device.add_argument(
        "--model",
        required=True,
        metavar="PRESET|PATH",
        help="a model preset "
        "(llama-3.1-8b, llama-3.1-70b, qwen3-8b, smollm2-135m, tiny) or config.json",
    )
    device.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    device.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="GPUs of one node the model is sharded over (all-reduce times from the profile)",
    )
    device.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of device memory for weights and KV cache (vLLM's; default 0.9)",
    )
    device.add_argument(
        "--device-memory-gib", type=float, help="device memory (default: the preset's datasheet)"
    )
    device.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks, exactly")
    device.add_argument(
        "--device-slowdown",
        type=float,
        default=1.0,
        help="the modeled device runs this many times slower than the profile predicts, while "
        "the policy believes the profile and corrects itself online (default 1)",
    )

    engine = parser.add_argument_group("engine (the flags and defaults of bullet serve)")
    engine.add_argument("--max-model-len", type=int)
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
        default=0.02,
        help="log-normal sigma of per-step time noise (default 0.02; 0: exact predictions)",
    )

    slo = parser.add_argument_group("SLOs (default: the paper's for the dataset)")
    slo.add_argument("--slo-ttft-per-token-ms", type=float)
    slo.add_argument(
        "--slo-ttft-base-ms",
        type=float,
        default=0.0,
        help="a fixed part of the TTFT SLO, added to input tokens x the per-token SLO",
    )
    slo.add_argument("--slo-tpot-ms", type=float)

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


def run(args: argparse.Namespace) -> int:
    from bulletserve.bench.datasets import DatasetError, RandomLengths
    from bulletserve.bench.report import summary_table
    from bulletserve.cli.bench import _rates, _slo
    from bulletserve.sim.benchmark import SimConfig, simulate
    from bulletserve.sim.hardware import SimSetupError

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
            tensor_parallel_size=args.tensor_parallel_size,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            device_memory_gib=args.device_memory_gib,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            device_slowdown=args.device_slowdown,
            label=args.label,
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
