"""The simulator's defaults, light to import: the `bullet simulate` flags take them from here."""

from __future__ import annotations

DEFAULT_NOISE = 0.02  # log-normal sigma of the per-step time noise
CAPACITY_TARGET = 0.9  # the SLO attainment a rate must keep to count toward capacity
CAPACITY_POLICIES = ("bullet", "chunked-1024", "chunked-2048", "prefill-first")
# Rate grids (req/s) from where every policy keeps 90% to past where each falls below it, on
# the A100 preset with Llama-3.1-8B (2026-12-01: 25-30, 3.5-6 and 3-4.5 req/s).
CAPACITY_GRIDS = {
    "sharegpt-like": tuple(float(r) for r in range(20, 42, 2)),
    "azure-code-like": tuple(r / 4 for r in range(12, 29)),
    "arxiv-sum-like": tuple(r / 4 for r in range(10, 23)),
}
PAPER_WORKLOADS = ("sharegpt-like", "azure-code-like", "arxiv-sum-like")
