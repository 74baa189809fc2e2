"""Capacity at an SLO on a modeled device (`bullet simulate capacity`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulletserve.cli import main as bullet
from bulletserve.sim.capacity import (
    PolicySettings,
    Task,
    capacity,
    median_attainment,
    policy_settings,
    ratio_line,
    walk,
)

# The profile of a 2-vCPU AMD Zen 3 guest in fp32 (docs/simulation.md, its CPU capacity grid).
CPU_PROFILE = Path(__file__).parents[1] / "fixtures" / "cpu-profile-zen3-fp32.json"


def main(argv: list[str]) -> int:
    try:
        return bullet(["simulate", "capacity", *argv])
    except SystemExit as exc:  # argparse's own errors (a flag's type)
        return int(exc.code)


def test_capacity_is_the_last_rate_of_an_unbroken_run_at_the_target():
    assert capacity({1.0: 0.99, 2.0: 0.95, 3.0: 0.9, 4.0: 0.89, 5.0: 0.97}) == 3.0
    assert capacity({2.0: 0.5, 1.0: 0.95}) == 1.0  # rates are taken in order, not as given
    assert capacity({1.0: 0.8, 2.0: 0.99}) is None
    assert capacity({1.0: 0.85}, target=0.8) == 1.0


def test_median_counts_a_walk_that_stopped_before_a_rate_as_a_miss_there():
    walks = [{1.0: 0.9, 2.0: 0.8}, {1.0: 1.0, 2.0: 0.95, 3.0: 0.91}, {1.0: 0.7}]
    assert median_attainment(walks) == {1.0: 0.9, 2.0: 0.8, 3.0: None}
    assert median_attainment([{1.0: 0.95}, {1.0: 0.92, 2.0: 0.99}]) == {1.0: 0.935, 2.0: None}
    assert capacity({1.0: 0.95, 2.0: None, 3.0: 0.99}) == 1.0


def test_ratio_is_bullet_over_the_best_baseline():
    line = ratio_line(
        {"bullet": 5.0, "bullet-no-fuse": 6.0, "chunked-1024": 4.0, "prefill-first": 2.0}
    )
    assert "chunked-1024" in line and "1.25x" in line
    assert "undefined" in ratio_line({"bullet": None, "chunked-1024": 4.0})
    assert "undefined" in ratio_line({"bullet": 3.0, "chunked-1024": None})


def test_policy_labels():
    assert policy_settings("chunked-512") == PolicySettings("chunked", 512)
    assert policy_settings("bullet") == PolicySettings("bullet")
    assert policy_settings("bullet-no-fuse") == PolicySettings("bullet", fuse_decode=False)
    assert policy_settings("bullet-without-turns+balance") == PolicySettings(
        "bullet", without_rules=("turns", "balance")
    )
    for bad in ("chunked-x", "fcfs", "bullet-without-sharing", "bullet-without-decode-grows"):
        with pytest.raises(ValueError, match=bad):
            policy_settings(bad)


def test_a_walk_stops_after_two_misses_in_a_row():
    # A target above 100% that no rate can keep: the walk stops after the first two.
    task = Task(
        "h100", "llama-3.1-8b", "sharegpt-like", "chunked-1024", 0, 20, (1.0, 2.0, 3.0), 1.01
    )
    attained = walk(task)
    assert list(attained) == [1.0, 2.0]
    assert all(0.9 <= a <= 1.0 for a in attained.values())  # 1-2 req/s: nearly all meet the SLOs


def test_end_to_end_writes_the_table_the_plot_and_the_grids(tmp_path, capsys):
    out, results = tmp_path / "cap.png", tmp_path / "cap.json"
    code = main(
        [
            "--hardware", "h100", "--workloads", "sharegpt-like", "--policies",
            "bullet,chunked-1024", "--seeds", "0", "--num-prompts", "30", "--rates", "1,2",
            "--out", str(out), "--results", str(results),
        ]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "| bullet |" in text and "| chunked-1024 |" in text and "bullet / best baseline" in text
    assert out.stat().st_size > 0
    grids = json.loads(results.read_text())
    assert grids["simulated"] is True and grids["hardware"] == "h100"
    # Two requests a second of ShareGPT are far below what an H100 serves: both keep the SLOs.
    for policy in ("bullet", "chunked-1024"):
        assert min(grids["attainment"]["sharegpt-like"][policy].values()) >= 0.9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "bullet,fcfs"], "fcfs"),
        (["--rates", "1,x"], "--rates"),
        (["--workloads", "random"], "--workloads"),
        (["--hardware", "tpu"], "--hardware 'tpu'"),
        (["--slo-tpot-ms", "100"], "go together"),
    ],
)
def test_bad_flags_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_cpu_profile_with_its_own_slos(tmp_path, capsys):
    """The CPU benchmark's setting: a measured profile, fp32, the server's context length and
    KV pool, SLOs with a fixed part."""
    code = main(
        [
            "--hardware", str(CPU_PROFILE), "--model", "smollm2-135m", "--dtype", "float32",
            "--max-model-len", "768", "--num-gpu-blocks-override", "2048",
            "--workloads", "sharegpt-like", "--policies", "bullet,chunked-128", "--seeds", "0",
            "--num-prompts", "20", "--rates", "0.25",
            "--slo-ttft-base-ms", "126.6", "--slo-ttft-per-token-ms", "6.982",
            "--slo-tpot-ms", "140.6", "--results", str(tmp_path / "cap.json"),
        ]
    )  # fmt: skip
    assert code == 0
    assert "SLO 126.6 ms + 6.982 ms/token, 140.6 ms TPOT" in capsys.readouterr().out
    grids = json.loads((tmp_path / "cap.json").read_text())
    assert grids["slo"] == {"ttft_per_token_ms": 6.982, "tpot_ms": 140.6, "ttft_base_ms": 126.6}
    for policy in ("bullet", "chunked-128"):
        assert grids["attainment"]["sharegpt-like"][policy]["0.25"] >= 0.9
