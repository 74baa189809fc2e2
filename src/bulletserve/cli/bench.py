"""`bullet bench`: load an OpenAI-compatible server and measure it (vLLM's metric definitions).

bullet bench --base-url URL --dataset SPEC --num-prompts N --request-rate R [...]
bullet bench compare A.json B.json ...
bullet bench plot A.json B.json ... --out DIR
bullet bench table A.json B.json ... [--slo BASE,PER_TOKEN,TPOT] [--loose-ttft-factor F]
bullet bench misses A.json B.json ... [--slo BASE,PER_TOKEN,TPOT]
bullet bench merge --out DIR A.json B.json ...
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path

from bulletserve.cli import CLIError


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    parser = subparsers.add_parser(
        name,
        help="benchmark a serving endpoint (bulletserve, vLLM, SGLang)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.set_defaults(run=run)
    actions = parser.add_subparsers(
        dest="bench_action", metavar="{compare,plot,table,misses,merge}"
    )
    compare = actions.add_parser("compare", help="runs side by side, with ratios to the first")
    compare.add_argument("files", nargs="+", type=Path, metavar="RESULT.json")
    plot = actions.add_parser("plot", help="draw the plots of one or more result files")
    plot.add_argument("files", nargs="+", type=Path, metavar="RESULT.json")
    plot.add_argument("--out", type=Path, required=True, metavar="DIR")
    plot.add_argument(
        "--step-log",
        type=Path,
        metavar="PATH",
        help="the server's --step-log: also draw the lane split over time",
    )
    table = actions.add_parser(
        "table", help="a sweep's table: attainment, goodput, latency; highest rate at 90%%"
    )
    table.add_argument("files", nargs="+", type=Path, metavar="RESULT.json")
    table.add_argument(
        "--slo", metavar="BASE_MS,PER_TOKEN_MS,TPOT_MS", help="rescore at these TTFT/TPOT SLOs"
    )
    table.add_argument("--loose-ttft-factor", type=float, default=2.0, metavar="F")
    misses = actions.add_parser("misses", help="which SLO each configuration's requests missed")
    misses.add_argument("files", nargs="+", type=Path, metavar="RESULT.json")
    misses.add_argument(
        "--slo", metavar="BASE_MS,PER_TOKEN_MS,TPOT_MS", help="score at these TTFT/TPOT SLOs"
    )
    merge = actions.add_parser(
        "merge", help="one result per configuration from several sweeps (reruns replace runs)"
    )
    merge.add_argument("files", nargs="+", type=Path, metavar="RESULT.json")
    merge.add_argument("--out", type=Path, required=True, metavar="DIR")

    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    target.add_argument("--model", help="model name to request (default: the server's first)")
    target.add_argument(
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME",
        help="LoRA adapters served (names, space- or comma-separated; the base model's name "
        "for base requests): the requests name them in turn",
    )
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    target.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="fail a request that goes S seconds without data (default 600)",
    )

    data = parser.add_argument_group("workload")
    data.add_argument(
        "--dataset",
        default="sharegpt-like",
        help="sharegpt:PATH, azure:PATH, random, sharegpt-like, azure-code-like, "
        "arxiv-sum-like, or with shared prefixes shared-prefix (a few long system prompts) and "
        "multi-turn (conversations resending their history), or grounded (copy, quote, "
        "rewrite or summarize a passage of shipped text or code: where speculative decoding's "
        "drafts hold) (default sharegpt-like)",
    )
    data.add_argument("--num-prompts", type=int, default=200)
    data.add_argument(
        "--tokenizer",
        metavar="NAME_OR_PATH",
        help="tokenizer that sets prompt lengths (default: the embedded default "
        "model's, which dummy presets share)",
    )
    data.add_argument("--input-len", type=int, default=1024, help="random: input tokens")
    data.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    data.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in len*(1-r)..len*(1+r)",
    )
    data.add_argument(
        "--max-model-len",
        type=int,
        help="shrink lengths to fit this context (default: the server's, if listed)",
    )
    data.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf", help="mean requests/s, or inf")
    load.add_argument("--request-rates", metavar="R1,R2,...", help="a sweep, e.g. 2,4,8")
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 steadier",
    )
    load.add_argument("--max-concurrency", type=int)
    load.add_argument(
        "--trace-arrivals",
        action="store_true",
        help="azure: send at the trace's timestamps (scaled to the rate unless inf)",
    )
    load.add_argument("--ignore-eos", action="store_true")
    load.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="every request's temperature, as vLLM's client sends it (0: greedy; default: "
        "none sent, the server's own)",
    )

    slo = parser.add_argument_group("SLOs")
    add_slo_args(slo)
    slo.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="goodput SLOs, e.g. ttft:500 tpot:50 e2el:10000",
    )
    add_service_class_args(slo)

    out = parser.add_argument_group("output")
    out.add_argument("--label", help="name of this run in tables and plots")
    out.add_argument("--output", type=Path, metavar="RESULT.json")
    out.add_argument("--plot", type=Path, metavar="DIR")
    out.add_argument("--no-progress", action="store_true", help="no live progress bar")


def add_slo_args(group: argparse._ActionsContainer) -> None:
    """The SLO flags, as `bullet bench`, `bullet simulate` and its capacity study take them."""
    group.add_argument(
        "--slo-ttft-per-token-ms",
        type=float,
        help="TTFT SLO per prompt token (default: the paper's for the dataset)",
    )
    group.add_argument(
        "--slo-ttft-base-ms",
        type=float,
        default=0.0,
        help="a fixed part of the TTFT SLO, added to input tokens x the per-token SLO",
    )
    group.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO (default: the paper's)")


def add_service_class_args(group: argparse._ActionsContainer) -> None:
    """A mixed workload's classes, as `bullet bench` and `bullet simulate` take them."""
    group.add_argument(
        "--service-class",
        action="append",
        default=[],
        metavar="NAME:SHARE:TTFT_PER_TOKEN_MS,TPOT_MS[,TTFT_BASE_MS][:PRIORITY]",
        help="a class of a mixed workload (repeatable; the shares sum to 1): its share of the "
        "requests, drawn by --seed, each scored at the class's SLO, per class and over all "
        "(in place of the --slo-* flags)",
    )
    group.add_argument(
        "--send-priority",
        action="store_true",
        help="each request asks for its class's priority (a server started with "
        "--scheduling-policy priority)",
    )
    group.add_argument(
        "--send-slo",
        action="store_true",
        help="each request names its class in `slo` (a bulletserve server started with "
        "--slo-class NAME=TTFT_PER_TOKEN_MS,TPOT_MS for each class)",
    )


def service_classes(args: argparse.Namespace) -> tuple:
    """The --service-class flags, checked (CLIError naming the flag)."""
    from bulletserve.bench.classes import check_classes, parse_workload_class

    if not args.service_class:
        if args.send_priority or args.send_slo:
            raise CLIError("--send-priority and --send-slo need --service-class")
        return ()
    try:
        classes = [parse_workload_class(text) for text in args.service_class]
        check_classes(classes)
    except ValueError as exc:
        raise CLIError(f"--service-class: {exc}") from None
    return tuple(classes)


def run(args: argparse.Namespace) -> int:
    if args.bench_action == "compare":
        from bulletserve.bench.report import compare_table

        print(compare_table(_load_all(args.files)))
        return 0
    if args.bench_action == "plot":
        from bulletserve.bench.plots import plot_results

        results = _load_all(args.files)
        for path in plot_results(results, args.out):
            print(path)
        if args.step_log:
            from bulletserve.bench.steplog import plot_step_log

            try:
                print(plot_step_log(args.step_log, results, args.out / "split_timeline.png"))
            except (OSError, ValueError) as exc:
                raise CLIError(f"--step-log: {exc}") from None
        return 0
    if args.bench_action in ("table", "misses", "merge"):
        return _tables(args)
    return _run_benchmark(args)


def _tables(args: argparse.Namespace) -> int:
    from bulletserve.bench import tables

    if args.bench_action == "merge":
        try:
            merged = tables.merge(args.files)
        except (OSError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        args.out.mkdir(parents=True, exist_ok=True)
        for label, result in merged.items():
            path = args.out / f"{label}.json"
            result.save(path)
            print(f"{path}: {label}, rates {', '.join(f'{r.request_rate:g}' for r in result.runs)}")
        return 0
    results = _load_all(args.files)
    try:
        slo = tables.parse_slo(args.slo) if args.slo else None
    except ValueError as exc:
        raise CLIError(f"--slo: {exc}") from None
    try:
        if args.bench_action == "misses":
            print(tables.misses_table(results, slo))
            return 0
        if not args.loose_ttft_factor > 0:
            raise CLIError(f"--loose-ttft-factor must be > 0, not {args.loose_ttft_factor}")
        print(tables.sweep_table(results, slo, args.loose_ttft_factor))
    except ValueError as exc:  # a run without SLOs and no --slo
        raise CLIError(str(exc)) from None
    return 0


def _load_all(paths: list[Path]) -> list:
    from bulletserve.bench.records import load_result

    try:
        return [load_result(path) for path in paths]
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _run_benchmark(args: argparse.Namespace) -> int:
    from bulletserve.bench.datasets import RandomLengths
    from bulletserve.bench.http_client import ServerUnreachable, server_root
    from bulletserve.bench.prompt_tokenizer import bench_tokenizer
    from bulletserve.bench.report import summary_table
    from bulletserve.bench.sweep import BenchConfig, run_benchmark

    config = BenchConfig(
        base_url=server_root(args.base_url),
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        request_rates=_rates(args),
        endpoint=args.endpoint,
        model=args.model,
        tokenizer=args.tokenizer,
        burstiness=_positive(args.burstiness, "--burstiness"),
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        max_model_len=args.max_model_len,
        random_lengths=RandomLengths(args.input_len, args.output_len, args.range_ratio),
        trace_arrivals=args.trace_arrivals,
        slo=_slo(args),
        goodput_ms=_goodput(args.goodput),
        service_classes=service_classes(args),
        send_priority=args.send_priority,
        send_slo=args.send_slo,
        lora_modules=tuple(
            name for entry in args.lora_modules for name in entry.split(",") if name
        ),
        label=args.label,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
    )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise CLIError("--max-concurrency must be at least 1")
    try:
        tokenizer = bench_tokenizer(args.tokenizer)
        result = asyncio.run(
            run_benchmark(
                config,
                tokenizer,
                progress=not args.no_progress,
                on_run=lambda run: print(summary_table(run), flush=True),
            )
        )
    except (ServerUnreachable, ValueError) as exc:
        raise CLIError(str(exc)) from None
    if args.output:
        result.save(args.output)
        print(f"results: {args.output}")
    if args.plot:
        from bulletserve.bench.plots import plot_results

        plot_results([result], args.plot)
        print(f"plots: {args.plot}/")
    failed = sum(run.summary["failed"] for run in result.runs)
    sent = sum(run.summary["num_requests"] for run in result.runs)
    if failed:
        print(f"{failed} of {sent} requests failed", file=sys.stderr)
    return 1 if failed == sent else 0


def _rates(args: argparse.Namespace) -> tuple[float, ...]:
    text = args.request_rates or args.request_rate
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CLIError(f"request rates must be numbers or inf, not {text!r}") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise CLIError(f"request rates must be positive (or inf), not {text!r}")
    return rates


def _positive(value: float, flag: str) -> float:
    if not value > 0:
        raise CLIError(f"{flag} must be positive")
    return value


def _slo(args: argparse.Namespace):
    from bulletserve.bench.datasets import PAPER_SLOS, dataset_family
    from bulletserve.sched.slo import SLO

    default = PAPER_SLOS.get(dataset_family(args.dataset) or "")
    ttft = args.slo_ttft_per_token_ms or (default.ttft_per_token_ms if default else None)
    tpot = args.slo_tpot_ms or (default.tpot_ms if default else None)
    if ttft is None and tpot is None:
        return None
    if ttft is None or tpot is None:
        raise CLIError("give both --slo-ttft-per-token-ms and --slo-tpot-ms for this dataset")
    if not args.slo_ttft_base_ms >= 0:
        raise CLIError(f"--slo-ttft-base-ms must be >= 0, not {args.slo_ttft_base_ms}")
    return SLO(ttft, tpot, args.slo_ttft_base_ms)


def _goodput(items: list[str] | None) -> dict[str, float] | None:
    from bulletserve.bench.serving_metrics import GOODPUT_METRICS

    if not items:
        return None
    limits = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            limits[key] = float(value)
        except ValueError:
            raise CLIError(f"--goodput expects KEY:MS, not {item!r}") from None
        if key not in GOODPUT_METRICS or limits[key] <= 0:
            raise CLIError(f"--goodput keys are {', '.join(GOODPUT_METRICS)} with positive ms")
    return limits
