"""`bullet simulate fidelity`: replaying a run on the profile that produced it differs by
nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bulletserve.cli import main
from bulletserve.perf.hardware import load_preset
from bulletserve.sched.slo import SLO
from bulletserve.sim import fidelity
from bulletserve.sim.benchmark import SimConfig, simulate

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _fidelity(argv: list[str]) -> int:
    return main(["simulate", "fidelity", *argv])


def _cpu_profile(tmp_path: Path) -> Path:
    """A small CPU-like profile: 2 thread units, no GEMM waves, no calibration points."""
    raw = load_preset("h20").to_dict() | {
        "name": "test-cpu",
        "kind": "cpu",
        "units": 2,
        "unit_granularity": 1,
        "min_units": 1,
        "bandwidth_saturation_units": 2,
        "gemm_tile": None,
        "peak_flops": {"bfloat16": 2e11},
        "peak_bandwidth": 5e10,
        "step_overhead_s": 0.002,
        "calibration": {},
    }
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("policy", "chunk", "label"), [("chunked", 256, "chunked-256"), ("bullet", None, "bullet")]
)
def test_replaying_a_run_on_its_own_profile_matches(tmp_path, capsys, policy, chunk, label):
    profile = _cpu_profile(tmp_path)
    config = SimConfig(
        hardware=str(profile),
        model="smollm2-135m",
        policy=policy,
        chunked_prefill_size=chunk,
        num_prompts=20,
        request_rates=(1.0, 2.0),
        slo=SLO(3.0, 150.0),
        noise=0.0,
        num_gpu_blocks_override=4000,
    )
    measured = dataclasses.replace(simulate(config), simulated=False, hardware=None)
    measured_path = tmp_path / f"{label}.json"
    measured.save(measured_path)
    argv = [str(measured_path), "--profile", str(profile), "--noise", "0"]
    argv += ["--num-gpu-blocks-override", "4000", "--out-dir", str(tmp_path / "sim")]
    assert _fidelity(argv) == 0
    out = capsys.readouterr().out
    assert "largest difference 0.00x its target" in out and "mean TPOT ms" in out
    # Attainment differs by points, not by a ratio: an exact replay differs by none.
    attainment = [line for line in out.splitlines() if "| SLO attainment |" in line]
    assert len(attainment) == 2 and all(line.endswith("| +0.000 |") for line in attainment)
    assert (tmp_path / "sim" / f"sim-{label}.json").exists()


def test_group_takes_medians_over_repeated_runs_and_their_spread(tmp_path, capsys):
    profile = _cpu_profile(tmp_path)
    config = SimConfig(
        hardware=str(profile),
        model="smollm2-135m",
        policy="chunked",
        chunked_prefill_size=256,
        num_prompts=12,
        request_rates=(1.0,),
        slo=SLO(3.0, 150.0),
        noise=0.0,
        num_gpu_blocks_override=4000,
    )
    exact = dataclasses.replace(simulate(config), simulated=False, hardware=None)
    paths = []
    for factor in (1.0, 1.2, 2.0):  # two repeats 20% and 100% slower than the profile says
        runs = []
        for run in exact.runs:
            summary = json.loads(json.dumps(run.summary))
            summary["ttft_ms"]["mean"] *= factor
            runs.append(dataclasses.replace(run, summary=summary))
        path = tmp_path / f"repeat-{factor}" / "chunked-256.json"
        path.parent.mkdir()
        dataclasses.replace(exact, label="chunked-256", runs=runs).save(path)
        paths.append(str(path))
    argv = [*paths, "--group", "--profile", str(profile), "--noise", "0"]
    assert _fidelity(argv + ["--num-gpu-blocks-override", "4000"]) == 1
    out = capsys.readouterr().out
    ttft = next(line for line in out.splitlines() if "mean TTFT ms" in line)
    # The median run is 1.2x the simulation; the runs spread 2.0 / 1.0 - 1 = 100%.
    assert "(3) | 100% |" in ttft and "-16.7% * (within the spread)" in ttft
    assert "1 of 4 figures differ by more than their target, 1 of them by less than" in out


def test_policy_from_label():
    policy_of = fidelity.policy_of
    assert policy_of("chunked-1024") == ("chunked", 1024)
    assert policy_of("bullet (auto)") == ("bullet", None)
    assert policy_of("prefill-first") == ("prefill-first", None)
    with pytest.raises(ValueError, match="--policy"):
        policy_of("vllm")


def test_isolated_table_sets_each_request_beside_its_lone_prefill(capsys):
    from bulletserve.model.presets import get_preset
    from bulletserve.perf.execution_state import ExecutionState
    from bulletserve.perf.hardware import HardwareProfile
    from bulletserve.perf.model import PerfModel

    isolated = FIXTURES / "bench-cpu-3-isolated.json"
    profile = str(FIXTURES / "cpu-profile.json")
    fidelity.isolated_table(isolated, profile, "smollm2-135m", "bfloat16")
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:3] == "| 1"]
    data = json.loads(isolated.read_text())
    first = next(i for i, (tokens, _) in enumerate(data["requests"]) if str(tokens)[0] == "1")
    tokens = data["requests"][first][0]
    perf = PerfModel(get_preset("smollm2-135m"), HardwareProfile.load(profile), "bfloat16")
    predicted = perf.predict(ExecutionState(prefill_lens=(tokens,), prefill_units=2)).prefill_s
    measured = data["ttft_per_token_ms_all"][first] * tokens
    assert rows[0] == f"| {tokens} | {measured:.1f} | {predicted * 1e3:.1f} | " + (
        f"{measured - predicted * 1e3:+.1f} ms |"
    )


def test_profile_per_run_replays_each_run_on_the_profile_taken_before_it(tmp_path, capsys):
    """Two runs measured (here: simulated) on a machine whose speed halved between them: each
    replayed on the profile saved beside it matches exactly, and a missing one is named."""
    fast = _cpu_profile(tmp_path)
    slow_raw = json.loads(fast.read_text())
    slow_raw["peak_flops"] = {"bfloat16": 1e11}
    slow_raw["peak_bandwidth"] = 2.5e10
    runs = []
    for rate, raw in ((1.0, json.loads(fast.read_text())), (2.0, slow_raw)):
        path = tmp_path / f"bullet.rate-{rate:g}.profile.json"
        path.write_text(json.dumps(raw))
        config = SimConfig(
            hardware=str(path),
            model="smollm2-135m",
            policy="bullet",
            num_prompts=12,
            request_rates=(rate,),
            slo=SLO(3.0, 150.0),
            noise=0.0,
            num_gpu_blocks_override=4000,
        )
        runs += simulate(config).runs
    measured = dataclasses.replace(
        simulate(config), label="bullet", runs=runs, simulated=False, hardware=None
    )
    measured_path = tmp_path / "bullet.json"
    measured.save(measured_path)
    argv = [str(measured_path), "--profile-per-run", "--noise", "0"]
    assert _fidelity(argv + ["--num-gpu-blocks-override", "4000"]) == 0
    out = capsys.readouterr().out
    assert "largest difference 0.00x its target" in out and "0 of 8 figures" in out
    # On one profile for both, the slow run's replay is off.
    argv = [str(measured_path), "--profile", str(fast), "--noise", "0"]
    assert _fidelity(argv + ["--num-gpu-blocks-override", "4000"]) == 1
    (tmp_path / "bullet.rate-2.profile.json").unlink()
    assert _fidelity([str(measured_path), "--profile-per-run"]) == 2
    assert "bullet.rate-2.profile.json" in capsys.readouterr().err


def test_partition_from_label():
    partition_of = fidelity.partition_of
    assert partition_of("bullet") == "auto"
    assert partition_of("bullet-partition-none") == "none"
    assert partition_of("bullet-static-1-1") == "static:1/1"
    assert partition_of("bullet-static:3/5 (replayed)") == "static:3/5"
    assert partition_of("chunked-512") == "auto"
    assert partition_of("bullet-no-fuse") == "auto"
    assert partition_of("bullet-static-1-1-no-fuse") == "static:1/1"
    assert not fidelity.fuses_decode("bullet-no-fuse (replayed)")
    assert fidelity.fuses_decode("bullet")
    with pytest.raises(ValueError, match="partition"):
        partition_of("bullet-sideways")


def test_served_speed_replays_a_run_at_its_step_logs_own_speed(tmp_path, capsys):
    """A run measured (here: simulated) on a machine twice as slow as the profile says, whose
    host takes 3 ms + 0.5 ms a row between steps, with its step log beside it: replayed at the
    speed and host time its own steps show, it matches exactly."""
    fast = _cpu_profile(tmp_path)
    slow_raw = json.loads(fast.read_text())
    slow_raw["peak_flops"] = {"bfloat16": 1e11}
    slow_raw["peak_bandwidth"] = 2.5e10
    slow_raw["step_overhead_s"] = 0.004
    slow_raw["calibration"] = {"host_s_per_step": 0.003, "host_s_per_row": 0.0005}
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(slow_raw))
    config = SimConfig(
        hardware=str(slow),
        model="smollm2-135m",
        policy="prefill-first",
        num_prompts=20,
        request_rates=(1.0,),
        slo=SLO(3.0, 150.0),
        noise=0.0,
        num_gpu_blocks_override=4000,
    )
    log = tmp_path / "prefill-first.steps.jsonl"
    measured = simulate(config, step_log=log)
    measured = dataclasses.replace(measured, label="prefill-first", simulated=False, hardware=None)
    measured_path = tmp_path / "prefill-first.json"
    measured.save(measured_path)
    argv = [str(measured_path), "--profile", str(fast), "--noise", "0"]
    argv += ["--num-gpu-blocks-override", "4000"]
    assert _fidelity(argv) == 1  # on the fast profile as it is, the replay is off
    assert _fidelity([*argv, "--served-speed"]) == 0
    out = capsys.readouterr().out
    assert "served / predicted steps, prefill 2.00, decode 2.00" in out
    assert "host between steps 3.00 ms + 0.500 ms a row (profile 0.00 + 0.000)" in out
    assert "largest difference 0.00x its target" in out.splitlines()[-1]
    # A step log without each step's state (as written before 2026-12-01) cannot be used.
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    log.write_text(
        "".join(
            json.dumps({k: v for k, v in line.items() if k != "state"}) + "\n" for line in lines
        )
    )
    assert _fidelity([*argv, "--served-speed"]) == 2
    assert "prefill-first.steps.jsonl:1: not a step-log line" in capsys.readouterr().err
