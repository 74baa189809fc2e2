"""Derive GPU presets' GEMM alpha and all-reduce times from Vidur's measured timings.

Source: microsoft/vidur (MIT License), folder data/profiling/compute, commit 7d47513; a copy
lives in the project's shared data folder (never committed here). Each CSV row holds one layer's
op latencies (ms) at `num_tokens` rows on a whole GPU. alpha(rows) = measured time of the four
GEMMs (fused q/k/v, o, gate+up, down; medians over repeated rows) / their roofline T' on the
preset at all SMs. Attention is not in the data, so the same GEMM alpha serves both phases.

The all-reduce CSVs (`*_dgx_all_reduce.csv`) hold NCCL all-reduce times
by `size` (fp16 elements: Vidur's profiler all-reduces a float16 buffer of that many) and
ranks; `all_reduce_points` keeps the ranks of one node (`num_workers == devices_per_node`).

    python -m bulletserve.perf.vidur CSV PRESET        # prints the alpha points as JSON
    python -m bulletserve.perf.vidur --all-reduce CSV  # the all-reduce points by ranks
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from bulletserve.model.config import ModelConfig
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.hardware import HardwareProfile, Points, load_preset
from bulletserve.perf.model import PerfModel

GEMM_COLUMNS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
GEMM_OPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
DTYPE = "float16"  # Vidur profiles fp16


def _config(row: dict[str, str]) -> ModelConfig:
    h, heads = int(row["n_embd"]), int(row["n_head"])
    return ModelConfig(
        family="llama",
        vocab_size=int(row["vocab_size"]),
        hidden_size=h,
        intermediate_size=int(row["n_expanded_embd"]),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=int(row["n_kv_head"]),
        head_dim=h // heads,
        max_position_embeddings=32768,
    )


def gemm_roofline(cfg: ModelConfig, hw: HardwareProfile, rows: int) -> float:
    """T' of one layer's four GEMMs at `rows` rows on all of `hw`'s units."""
    es = ExecutionState(prefill_lens=(rows,), prefill_units=hw.units)
    times = PerfModel(cfg, hw, DTYPE).op_breakdown(es, "prefill")
    return sum(times[name] for name in GEMM_OPS)


def gemm_alpha_points(path: str | Path, hw: HardwareProfile, powers_of_two: bool = True) -> Points:
    """(rows, alpha) at tensor-parallel degree 1, at power-of-two row counts by default."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "1"]
    if not rows:
        raise ValueError(f"{path}: no rows with num_tensor_parallel_workers == 1")
    cfg = _config(rows[0])
    measured: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        ms = sum(float(r[f"time_stats.{c}.median"]) for c in GEMM_COLUMNS)
        measured[int(r["num_tokens"])].append(ms / 1e3)
    points = []
    for n in sorted(measured):
        if powers_of_two and n & (n - 1):
            continue
        alpha = statistics.median(measured[n]) / gemm_roofline(cfg, hw, n)
        points.append((float(n), round(alpha, 4)))
    return tuple(points)


VIDUR_ALL_REDUCE_BYTES = 2  # per element: a float16 buffer


def all_reduce_points(path: str | Path) -> dict[int, Points]:
    """Ranks -> (bytes, seconds) points of one node's all-reduce: the median time and size in
    each power-of-two size band, made non-decreasing (small sizes are latency-bound, and their
    medians scatter around it)."""
    bands: dict[int, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["collective"] != "all_reduce" or r["num_workers"] != r["devices_per_node"]:
                continue
            size = int(r["size"]) * VIDUR_ALL_REDUCE_BYTES
            seconds = float(r["time_stats.all_reduce.median"]) / 1e3
            bands[int(r["num_workers"])][size.bit_length()].append((size, seconds))
    if not bands:
        raise ValueError(f"{path}: no all-reduce rows within one node")
    out: dict[int, Points] = {}
    for ranks, by_band in sorted(bands.items()):
        points, floor = [], 0.0
        for band in sorted(by_band):
            sizes, times = zip(*by_band[band], strict=True)
            floor = max(floor, statistics.median(times))
            points.append((float(statistics.median(sizes)), round(floor, 8)))
        out[ranks] = tuple(points)
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--all-reduce":
        table = all_reduce_points(argv[1])
        print(json.dumps({str(r): [list(p) for p in pts] for r, pts in table.items()}))
        return 0
    path, preset = argv
    print(json.dumps([list(p) for p in gemm_alpha_points(path, load_preset(preset))]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
