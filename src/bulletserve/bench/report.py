"""Text output: the summary table of a run and the side-by-side comparison of result files."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bulletserve.bench.records import BenchResult, RunResult

_WIDTH = 52

# (row title, path into the summary)
COMPARE_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Completed", ("completed",)),
    ("Failed", ("failed",)),
    ("Request throughput (req/s)", ("request_throughput",)),
    ("Output throughput (tok/s)", ("output_throughput",)),
    ("Total token throughput (tok/s)", ("total_token_throughput",)),
    ("Goodput (req/s)", ("request_goodput",)),
    ("SLO attainment (fraction)", ("slo", "attainment")),
    ("P90 norm. TTFT (ms/token)", ("slo", "p90_norm_ttft_ms")),
    ("P90 TPOT, SLO set (ms)", ("slo", "p90_tpot_ms")),
    ("Mean TTFT (ms)", ("ttft_ms", "mean")),
    ("P90 TTFT (ms)", ("ttft_ms", "p90")),
    ("P99 TTFT (ms)", ("ttft_ms", "p99")),
    ("Mean TPOT (ms)", ("tpot_ms", "mean")),
    ("P90 TPOT (ms)", ("tpot_ms", "p90")),
    ("P99 TPOT (ms)", ("tpot_ms", "p99")),
    ("Mean ITL (ms)", ("itl_ms", "mean")),
    ("P99 ITL (ms)", ("itl_ms", "p99")),
    ("Mean E2EL (ms)", ("e2el_ms", "mean")),
    ("P99 E2EL (ms)", ("e2el_ms", "p99")),
)


def lookup(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, int | float) else None


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.4f}"


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def summary_table(run: RunResult, simulated: bool = False) -> str:
    """vLLM-style result block for one load level (`simulated`: of a simulator's run, whose
    times are simulated seconds)."""
    s = run.summary
    kind = "Simulated Serving Result" if simulated else "Serving Benchmark Result"
    lines = [f" {kind} (rate {rate_name(run.request_rate)}) ".center(_WIDTH, "=")]

    def row(title: str, value: float | None) -> None:
        lines.append(f"{title:<40} {_fmt(value):>11}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if run.max_concurrency:
        row("Maximum request concurrency:", run.max_concurrency)
    row("Simulated duration (s):" if simulated else "Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if "request_goodput" in s:
        row("Request goodput (req/s):", s["request_goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        lines.append(title.center(_WIDTH, "-"))
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p90", "p99", "std"):
            row(f"{stat.capitalize()} {short} (ms):", s[key][stat])
    if "classes" in s:
        lines.append("SLO attainment per class".center(_WIDTH, "-"))
        for name, score in s["classes"].items():
            attained = score["attainment"]
            lines.append(
                f"  {name} ({score['requests']} requests, TTFT {score['ttft_per_token_ms']:g} "
                f"ms/token, TPOT {score['tpot_ms']:g} ms, priority {score['priority']}): "
                + ("-" if attained is None else f"{100 * attained:.1f}%")
                + f", goodput {score['goodput']:.2f} req/s"
            )
        attained = s["slo"]["attainment"]
        row("SLO attainment, all (%):", None if attained is None else 100.0 * attained)
        row("Goodput, all (req/s):", s["slo"]["goodput"])
    elif "slo" in s:
        slo = s["slo"]
        base = slo.get("ttft_base_ms") or 0.0
        per_token = f"{slo['ttft_per_token_ms']:g} ms/token"
        ttft = f"{base:g} ms + {per_token}" if base else per_token
        title = f"SLO: TTFT {ttft}, TPOT {slo['tpot_ms']:g} ms"
        lines.append(title.center(_WIDTH, "-"))
        attained = slo["attainment"]
        row("SLO attainment (%):", None if attained is None else 100.0 * attained)
        row("P90 normalized TTFT (ms/token):", slo["p90_norm_ttft_ms"])
        row("P90 TPOT (ms):", slo["p90_tpot_ms"])
    if "spec_decode" in s:
        spec = s["spec_decode"]
        lines.append("Speculative Decoding".center(_WIDTH, "-"))
        rate = spec["acceptance_rate"]
        row("Acceptance rate (%):", None if rate is None else 100.0 * rate)
        row("Acceptance length:", spec["mean_acceptance_length"])
        row("Drafts:", spec["num_drafts"])
        row("Draft tokens:", spec["num_draft_tokens"])
        row("Accepted tokens:", spec["num_accepted_tokens"])
    for error, count in s["errors"].items():
        lines.append(f"  {count} x {error}")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def compare_table(results: Sequence[BenchResult]) -> str:
    """Runs side by side, one block per request rate; ratios are against the first file."""
    rates = sorted({run.request_rate for result in results for run in result.runs})
    blocks = []
    for rate in rates:
        runs = [next((r for r in res.runs if r.request_rate == rate), None) for res in results]
        headers = ["metric"] + [res.display_label for res in results]
        headers += [f"{res.display_label} / {results[0].display_label}" for res in results[1:]]
        rows = []
        for title, path in COMPARE_ROWS:
            values = [lookup(run.summary, path) if run else None for run in runs]
            if all(v is None for v in values):
                continue
            ratios = [_ratio(v, values[0]) for v in values[1:]]
            rows.append([title] + [_fmt(v) for v in values] + ratios)
        widths = [
            max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)
        ]
        lines = [f"request rate {rate_name(rate)}"]
        for cells in [headers, *rows]:
            lines.append(
                "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"
