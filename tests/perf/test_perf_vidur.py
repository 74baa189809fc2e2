"""The GPU presets' committed GEMM alpha matches a re-derivation from Vidur's data."""

from __future__ import annotations

from pathlib import Path

import pytest

from bulletserve.perf.hardware import load_preset
from bulletserve.perf.vidur import all_reduce_points, gemm_alpha_points

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpu-op-timings"


@pytest.mark.parametrize(
    ("preset", "csv_name"),
    [("a100-80gb", "a100_meta-llama-3-8b_mlp.csv"), ("h100-sxm", "h100_llama-2-7b_mlp.csv")],
)
def test_committed_alpha_matches_data(preset, csv_name):
    path = DATA / csv_name
    if not path.exists():
        pytest.skip(f"{path} absent (shared data is not in users' clones)")
    prof = load_preset(preset)
    derived = gemm_alpha_points(path, prof)
    assert prof.calibration.alpha["prefill"][prof.units] == derived
    assert prof.calibration.alpha["decode"][prof.units] == derived
    alphas = [a for _, a in derived]
    assert 0.8 < min(alphas) and max(alphas) < 2.0


@pytest.mark.parametrize(
    ("preset", "csv_name"),
    [("a100-80gb", "a100_dgx_all_reduce.csv"), ("h100-sxm", "h100_dgx_all_reduce.csv")],
)
def test_committed_all_reduce_times_match_data(preset, csv_name):
    path = DATA / csv_name
    if not path.exists():
        pytest.skip(f"{path} absent (shared data is not in users' clones)")
    table = load_preset(preset).calibration.all_reduce_s
    assert table == all_reduce_points(path)
    assert sorted(table) == [2, 4, 8]
    for points in table.values():
        times = [t for _, t in points]
        assert times == sorted(times)  # never faster for a larger message
        assert 1e-6 < times[0] < 1e-4 and times[-1] < 2e-3
