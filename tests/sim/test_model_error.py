"""The policy on a profile it believes while the device is another: the simulated device runs
2x slower, or 2x faster, than the CPU profile bullet plans with. Its online corrections (the
simulator feeds them each step's modeled time, as the engine feeds measured ones) and its
chunked-plan rule keep bullet at or above chunked prefill, which needs no model, near capacity
in both. Before the chunked-plan rule, bullet fell below chunked in both (0.673 against 0.730
at 2x slower, 0.977 against 0.990 at 2x faster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bulletserve.sched.slo import SLO
from bulletserve.sim.benchmark import SimConfig, simulate

PROFILE = Path(__file__).resolve().parent.parent / "fixtures" / "cpu-profile.json"
# The SLOs docs/bullet-rules.md's ablations use on this profile (from its isolated latencies).
CPU_SLO = SLO(ttft_per_token_ms=1.274, tpot_ms=148.4, ttft_base_ms=167.0)


def attainment(policy: str, slowdown: float, rate: float) -> float:
    config = SimConfig(
        hardware=str(PROFILE),
        model="smollm2-135m",
        policy=policy,
        dataset="sharegpt-like",
        num_prompts=300,
        request_rates=(rate,),
        slo=CPU_SLO,
        dtype="bfloat16",
        max_model_len=768,
        num_gpu_blocks_override=4096,
        device_slowdown=slowdown,
    )
    (run,) = simulate(config).runs
    return run.summary["slo"]["attainment"]


@pytest.mark.parametrize(
    "slowdown, rate", [(2.0, 3.0), (0.5, 48.0)], ids=["2x-slower", "2x-faster"]
)
def test_bullet_stays_at_or_above_chunked_on_a_device_its_profile_misjudges(slowdown, rate):
    bullet, chunked = attainment("bullet", slowdown, rate), attainment("chunked", slowdown, rate)
    assert 0.5 < chunked < 1.0  # near capacity: the policies' choices matter
    assert bullet >= chunked


def test_the_simulated_device_teaches_the_policy_its_speed():
    """On a device 2x slower than believed, after a run of 60 requests the policy's
    predictions, under the corrections the steps taught it, are within 10% of the device's
    times for steps of the sizes it ran, where they started 2x off."""
    from bulletserve.bench.datasets import load_lengths
    from bulletserve.perf.execution_state import ExecutionState
    from bulletserve.sim.benchmark import make_sim_policy, setup, simulate_run

    config = SimConfig(
        hardware=str(PROFILE),
        model="smollm2-135m",
        policy="bullet",
        dataset="sharegpt-like",
        num_prompts=60,
        slo=CPU_SLO,
        dtype="bfloat16",
        max_model_len=768,
        num_gpu_blocks_override=4096,
        device_slowdown=2.0,
        noise=0.0,
    )
    env = setup(config)
    lengths = load_lengths(config.dataset, config.num_prompts, config.seed, 768)
    simulate_run(config, env, make_sim_policy(config, env), lengths, 2.0)
    perf = env.perf
    for es, phase in (
        (ExecutionState(decode_ctx=(300,) * 8, decode_units=2), "decode"),
        (ExecutionState(prefill_lens=(200,) + (1,) * 8, prefill_units=2), "prefill"),
    ):
        device = getattr(perf.device_s(es, 2.0), f"{phase}_s")
        believed = getattr(perf.uncorrected(es), f"{phase}_s")
        assert device == pytest.approx(2 * believed)
        assert getattr(perf.predict(es), f"{phase}_s") == pytest.approx(device, rel=0.1)
