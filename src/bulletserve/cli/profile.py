"""`bullet profile`: measure this device and write a hardware profile for the performance model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bulletserve.cli import CLIError, add_model_args


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    parser = subparsers.add_parser(
        name, help="measure the device (peaks, N_d, step times) and fit the performance model"
    )
    add_model_args(parser)
    parser.add_argument("--output", type=Path, default=Path("profile.json"))
    parser.add_argument("--name", default=None, help="profile name (default: the device's)")
    parser.add_argument("--quick", action="store_true", help="a smaller sweep (under 2 minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)
    actions = parser.add_subparsers(dest="profile_action", metavar="{validate}")
    validate = actions.add_parser(
        "validate",
        help="predicted against measured step times on shapes the fit did not see",
        description="Profiles this CPU with the embedded default model, measuring held-out "
        "prefill and decode shapes (alone and co-running) in the same rounds as the profile's "
        "own; fits on the profile's shapes only and compares the calibrated model, the plain "
        "roofline and a linear fit per phase on the held-out ones. Writes perf-model.json and "
        "the scatter plot perf-model.png.",
    )
    validate.add_argument("--quick", action="store_true", help="the quick plan's shapes")
    validate.add_argument("--repeats", type=int, help="measurement rounds (default: the plan's)")
    validate.add_argument("--out-dir", type=Path, default=Path("docs"))


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def summary(hw, samples) -> str:
    """The unit sweep and the fitted alpha range per phase and unit count, as a text table."""
    lines = [
        f"{hw.name}: {hw.units} {'SMs' if hw.kind == 'gpu' else 'threads'}, "
        f"N_d = {hw.bandwidth_saturation_units}, step overhead "
        f"{hw.step_overhead_s * 1e6:.0f} us",
        f"{'units':>6} {'GEMM GFLOP/s':>13} {'copy GB/s':>10}",
    ]
    for p in hw.calibration.unit_sweep:
        lines.append(f"{p.units:>6} {p.gemm_flops / 1e9:>13.1f} {p.bandwidth / 1e9:>10.1f}")
    lines.append(f"{'phase':<14} {'units':>6} {'points':>6} {'alpha min':>9} {'max':>7}")
    for phase, table in hw.calibration.alpha.items():
        for units, pts in table.items():
            alphas = [a for _, a in pts]
            lines.append(
                f"{phase:<14} {units:>6} {len(pts):>6} {min(alphas):>9.2f} {max(alphas):>7.2f}"
            )
    lines.append(f"{len(samples)} measured steps")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.profile_action == "validate":
        from bulletserve.cli import settings_of
        from bulletserve.profiling.validate import Settings, main

        return main(settings_of(Settings, args))
    import torch

    from bulletserve.engine.config import EngineConfig
    from bulletserve.engine.engine import LLMEngine, resolve_device
    from bulletserve.model.gguf_reader import GGUFError
    from bulletserve.model.loader import load_model, resolve_dtype
    from bulletserve.model.source import ModelNotFoundError, resolve_model
    from bulletserve.partition import UnitsUnavailableError, unit_provider
    from bulletserve.profiling.host import PROMPT_TOKENS as HOST_PROMPT_TOKENS
    from bulletserve.profiling.profiler import PLANS, profile_device, profile_host

    plan = PLANS["quick" if args.quick else "default"]
    started = time.perf_counter()
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        units = unit_provider(device)
        source = resolve_model(args.model, args.load_format)
        max_positions = max(plan.prefill_lens + plan.corun_prefill_lens + plan.decode_contexts)
        model = load_model(source, dtype, device, max_positions, seed=args.seed)
        # The engine whose host time per step the profile measures last, built first so that
        # a model it cannot serve (no tokenizer, say) fails before the sweeps, not after.
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                load_format=args.load_format,
                dtype=args.dtype,
                device=args.device,
                seed=args.seed,
                policy="prefill-first",
                max_num_seqs=max(plan.decode_batches),
                max_model_len=HOST_PROMPT_TOKENS + plan.host_tokens + 16,
                cpu_warmup_rows=0,  # the sweeps time every shape after a round that builds it
            ),
            model=model,
        )
    except (ModelNotFoundError, GGUFError, UnitsUnavailableError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    name = args.name or _device_name(device)
    print(
        f"profiling {name} with {source.name} ({dtype}), {'quick' if args.quick else 'full'} sweep",
        file=sys.stderr,
    )

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    with torch.inference_mode():
        run = profile_device(model, units, plan, name, log)
        hw, samples = run.hw, run.samples
        hw = profile_host(hw, engine, units, plan, log)
        engine.close()
    hw.save(args.output)
    print(summary(hw, samples))
    print(f"wrote {args.output} in {time.perf_counter() - started:.0f} s")
    return 0
