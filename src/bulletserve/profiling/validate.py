"""Predicted vs measured step times on shapes not used for fitting (the docs benchmark).

    bullet profile validate [--quick] [--repeats N] [--out-dir docs]

Profiles this CPU with the embedded default model (as `bullet profile` does), measuring
held-out prefill and decode shapes, alone and co-running, in the same rounds as the profile's
own (so that a drift of the machine between minutes does not pass for model error), fits on the
profile's shapes only, and compares three predictors on the held-out ones: the
calibrated model, the uncalibrated roofline T', and a plain linear fit t = a + b * rows per
(phase, units, co-running) on the same profiling samples. Writes perf-model.json and a
predicted-vs-measured scatter plot perf-model.png.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from bulletserve.model.loader import load_model
from bulletserve.model.source import resolve_model
from bulletserve.partition import CpuThreads
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.fit import StepSample
from bulletserve.perf.model import PerfModel
from bulletserve.profiling.profiler import PLANS, profile_device

# Held-out shapes: none of these lengths, batches or contexts is in a profiling plan.
PREFILL = [
    ((96,), ()),
    ((384,), ()),
    ((768,), ()),
    ((1536,), ()),
    ((200, 200), ()),
    ((256,), (512,)),
]
DECODE = [(b, ctx) for b in (2, 8, 24, 48) for ctx in (300, 800)]
CORUN = [((384,), 8, 300), ((768,), 24, 800), ((1536,), 2, 300), ((96,), 48, 800)]


def held_out_states(total: int) -> list[ExecutionState]:
    """The held-out shapes alone at every unit count and co-running at every split."""
    states = []
    for units in range(1, total + 1):
        states += [
            ExecutionState(prefill_lens=lens, prefill_cached=cached, prefill_units=units)
            for lens, cached in PREFILL
        ]
        states += [ExecutionState(decode_ctx=(ctx,) * b, decode_units=units) for b, ctx in DECODE]
    for p in range(1, total):
        states += [
            ExecutionState(
                prefill_lens=lens, prefill_units=p, decode_ctx=(ctx,) * b, decode_units=total - p
            )
            for lens, b, ctx in CORUN
        ]
    return states


def linear_fit(train: list[StepSample]) -> dict[tuple[str, int, bool], tuple[float, float]]:
    groups = defaultdict(list)
    for s in train:
        groups[(s.phase, s.units, s.corun)].append((s.rows, s.measured_s))
    fits = {}
    for key, pts in groups.items():
        x, y = np.array(pts).T
        fits[key] = tuple(np.polyfit(x, y, 1)) if len(set(x)) > 1 else (0.0, float(y.mean()))
    return fits


def errors(pred: list[float], meas: list[float]) -> dict[str, float]:
    rel = sorted(abs(p - m) / m for p, m in zip(pred, meas, strict=True))
    return {"median": statistics.median(rel), "p90": float(np.percentile(rel, 90)), "max": rel[-1]}


@dataclasses.dataclass(frozen=True)
class Settings:
    """`bullet profile validate`'s settings (its flags: cli/profile.py)."""

    quick: bool
    repeats: int | None
    out_dir: Path


def main(settings: Settings) -> int:
    """`bullet profile validate`: writes perf-model.json and perf-model.png, prints the errors."""
    units = CpuThreads()
    model = load_model(resolve_model(None), torch.bfloat16, torch.device("cpu"), 4096)
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    with torch.inference_mode():
        plan = PLANS["quick" if settings.quick else "default"]
        if settings.repeats:
            plan = dataclasses.replace(plan, repeats=settings.repeats)
        run = profile_device(
            model, units, plan, platform.machine(), log, held_out_states(units.total)
        )
    hw, train, test = run.hw, run.samples, run.held_out
    perf = PerfModel(model.config, hw)
    fits = linear_fit(train)
    rows = []
    for s in test:
        es = s.es
        corun = s.corun
        calibrated = getattr(perf.predict(es), f"{s.phase}_s")
        roofline = perf.roofline(es, s.phase, corun)
        slope, icept = fits[(s.phase, s.units, corun)]
        rows.append(
            {
                "phase": s.phase,
                "corun": corun,
                "units": s.units,
                "rows": s.rows,
                "es": str(es),
                "measured_s": s.measured_s,
                "calibrated_s": calibrated,
                "roofline_s": roofline,
                "linear_s": icept + slope * s.rows,
            }
        )
    meas = [r["measured_s"] for r in rows]
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {units.total} threads",
        "torch": torch.__version__,
        "profile": hw.to_dict(),
        "errors": {
            k: errors([r[f"{k}_s"] for r in rows], meas)
            for k in ("calibrated", "roofline", "linear")
        },
        "errors_by_group": {
            f"{ph}{'_corun' if c else ''}": errors(
                [r["calibrated_s"] for r in rows if r["phase"] == ph and r["corun"] == c],
                [r["measured_s"] for r in rows if r["phase"] == ph and r["corun"] == c],
            )
            for ph in ("prefill", "decode")
            for c in (False, True)
        },
        "samples": rows,
        "profile_samples": [
            {
                "phase": s.phase,
                "corun": s.corun,
                "units": s.units,
                "rows": s.rows,
                "other_rows": s.other_rows,
                "es": str(s.es),
                "measured_s": s.measured_s,
            }
            for s in train
        ],
    }
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    (settings.out_dir / "perf-model.json").write_text(json.dumps(report, indent=1) + "\n")
    _plot(rows, settings.out_dir / "perf-model.png")
    print(json.dumps({"errors": report["errors"], "by_group": report["errors_by_group"]}, indent=1))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    styles = {"calibrated": ("o", "C0"), "linear": ("x", "C1"), "roofline": ("^", "C2")}
    for key, (marker, color) in styles.items():
        ax.scatter(
            [r["measured_s"] * 1e3 for r in rows],
            [r[f"{key}_s"] * 1e3 for r in rows],
            marker=marker,
            color=color,
            label=key,
            alpha=0.7,
            s=20,
        )
    lo = min(min(r[f"{k}_s"] for k in ("measured", *styles)) for r in rows) * 1e3 / 2
    hi = max(r["measured_s"] for r in rows) * 1e3 * 2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured step (ms)",
        ylabel="predicted step (ms)",
        title="Held-out CPU steps: predicted vs measured",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
