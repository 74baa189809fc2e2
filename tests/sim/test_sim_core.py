"""The simulator: determinism, exact predictions without noise, conservation, policy sanity."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bulletserve.bench.datasets import RandomLengths, load_lengths
from bulletserve.bench.records import RequestRecord
from bulletserve.bookkeeping.record import read_step_log
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.model import PerfModel
from bulletserve.sched.bullet import RULE_NAMES, BulletParams, BulletPolicy
from bulletserve.sched.slo import SLO
from bulletserve.sim.benchmark import SimConfig, make_sim_policy, setup, simulate
from bulletserve.sim.device import Noise
from bulletserve.sim.device_presets import (
    DEVICE_MEMORY,
    GIB,
    SimSetupError,
    kv_cache_blocks,
    load_hardware,
)
from bulletserve.sim.laned import LanedSimulator
from bulletserve.sim.one_lane import run_single_lane
from bulletserve.sim.state import SimState
from bulletserve.sim.workload import arrivals_for, make_requests

SHAREGPT_SLO = SLO(3.0, 150.0)
POLICIES = [("bullet", None), ("chunked", 512), ("prefill-first", None)]


def _config(policy: str, chunk: int | None = None, **kw) -> SimConfig:
    base = dict(
        hardware="a100-80g",
        model="llama-3.1-8b",
        policy=policy,
        chunked_prefill_size=chunk,
        dataset="sharegpt-like",
        num_prompts=60,
        request_rates=(20.0,),
        slo=SHAREGPT_SLO,
        noise=0.05,
    )
    return SimConfig(**(base | kw))


@pytest.mark.parametrize(("policy", "chunk"), POLICIES)
def test_same_seed_same_result_other_seed_differs(policy, chunk):
    first = simulate(_config(policy, chunk)).to_json()
    again = simulate(_config(policy, chunk)).to_json()
    other = simulate(_config(policy, chunk, seed=1)).to_json()
    assert json.dumps(first) == json.dumps(again)
    assert first["runs"][0]["requests"] != other["runs"][0]["requests"]
    assert first["simulated"] is True and first["hardware"] == "A100-80GB-SXM"


def _lone_request(
    policy: str, chunk: int | None, prompt: int, output: int, **settings: object
) -> tuple[RequestRecord, PerfModel, float, list[float]]:
    """One request of `prompt` tokens in and `output` out, simulated alone without noise: its
    record, the performance model, and the model's prefill and per-decode-step predictions."""
    config = _config(
        policy,
        chunk,
        device_memory_gib=80.0,
        dataset="random",
        num_prompts=1,
        request_rates=(float("inf"),),
        random_lengths=RandomLengths(prompt, output),
        noise=0.0,
        **settings,
    )
    record = simulate(config).runs[0].requests[0]
    perf = setup(config).perf
    units = perf.hw.units
    ttft = perf.predict(ExecutionState(prefill_lens=(prompt,), prefill_units=units)).prefill_s
    decode = [
        perf.predict(ExecutionState(decode_ctx=(prompt + k,), decode_units=units)).decode_s
        for k in range(1, output)
    ]
    return record, perf, ttft, decode


@pytest.mark.parametrize("host_terms", [None, (2e-3, 5e-4)])
@pytest.mark.parametrize(("policy", "chunk"), POLICIES)
def test_single_request_without_noise_matches_the_model(policy, chunk, host_terms, tmp_path):
    """A lone request's TTFT and TPOT are the model's step predictions; with host terms in the
    profile, each step (one sampled row) is followed by the engine's host time."""
    prompt, output = 400, 6
    hardware, host = "a100-80g", 0.0
    if host_terms:
        hw = load_hardware(hardware)
        cal = dataclasses.replace(
            hw.calibration, host_s_per_step=host_terms[0], host_s_per_row=host_terms[1]
        )
        hardware, host = str(tmp_path / "a100-host.json"), sum(host_terms)
        dataclasses.replace(hw, calibration=cal).save(hardware)
    record, perf, ttft, decode = _lone_request(policy, chunk, prompt, output, hardware=hardware)
    assert perf.host_s(1) == pytest.approx(host)
    assert record.success and record.output_len == output
    assert record.ttft_s == pytest.approx(ttft + host, rel=1e-9)
    assert record.e2el_s - record.ttft_s == pytest.approx(sum(decode) + len(decode) * host)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("policy", "chunk"), POLICIES)
def test_the_host_time_given_is_charged_after_each_step_or_beside_it(policy, chunk, overlap):
    """`--host-ms-per-step`/`--host-us-per-row` replace the profile's host terms (a GPU preset
    has none); with `--host-overlap` a lone request's step takes the longer of the device's
    time and the host's, else their sum."""
    prompt, output, host = 400, 6, 2e-3 + 10e-3  # a step's host time: more than a decode's
    record, perf, ttft, decode = _lone_request(
        policy,
        chunk,
        prompt,
        output,
        host_s_per_step=2e-3,
        host_s_per_row=10e-3,
        host_overlap=overlap,
    )
    assert perf.host_s(1) == pytest.approx(host)
    assert max(decode) < host < ttft  # so that overlap hides the host's time only at the prompt
    if overlap:
        assert record.ttft_s == pytest.approx(ttft, rel=1e-9)
        assert record.e2el_s - record.ttft_s == pytest.approx(len(decode) * host)
    else:
        assert record.ttft_s == pytest.approx(ttft + host, rel=1e-9)
        assert record.e2el_s - record.ttft_s == pytest.approx(sum(decode) + len(decode) * host)


def test_host_settings_are_checked():
    with pytest.raises(ValueError, match="host_s_per_row"):
        _config("chunked", 512, host_s_per_row=-1e-6)
    with pytest.raises(ValueError, match="--host-overlap with --device-slowdown"):
        _config("chunked", 512, host_overlap=True, device_slowdown=2.0)


@pytest.mark.parametrize(("policy", "chunk"), POLICIES)
def test_conservation_under_preemption(policy, chunk):
    """A KV pool far too small for the load: requests are preempted and recomputed, yet every
    request finishes and every block comes back."""
    config = _config(
        policy, chunk, num_prompts=80, request_rates=(50.0,), num_gpu_blocks_override=160
    )
    env = setup(config)
    policy_obj = make_sim_policy(config, env)
    lengths = load_lengths(config.dataset, config.num_prompts, config.seed)
    requests = make_requests(lengths, arrivals_for(lengths, 50.0, 1.0, 0, False))
    state = SimState(requests, env.num_blocks, config.block_size, env.max_model_len)
    noise = Noise(config.noise, config.seed)
    if isinstance(policy_obj, BulletPolicy):
        LanedSimulator(state, policy_obj, env.perf, noise, 256, 2048).run()
    else:
        run_single_lane(state, policy_obj, env.perf, noise, 256, 2048)
    assert state.book.num_preemptions > 0
    assert all(r.finished_at is not None and r.error is None for r in requests)
    assert all(len(r.token_times) == r.output_len for r in requests)
    assert state.book.allocator.num_free == state.book.allocator.num_blocks
    assert not state.book.waiting and not state.book.running


def test_a_prompt_over_the_context_fails_and_the_rest_finish():
    from bulletserve.sim.request import SimRequest

    config = _config("chunked", 512)
    env = setup(config)
    requests = [SimRequest("long", 0, 0.0, 200, 4), SimRequest("ok", 1, 0.1, 50, 4)]
    state = SimState(requests, 64, 16, max_model_len=128)
    run_single_lane(state, make_sim_policy(config, env), env.perf, Noise(0.0, 0), 256, 2048)
    assert "max-model-len" in (requests[0].error or "")
    assert requests[1].finished_at is not None and len(requests[1].token_times) == 4
    assert state.book.allocator.num_free == 64


def _step_log(tmp_path, policy, chunk, **kw):
    path = tmp_path / "steps.jsonl"
    simulate(_config(policy, chunk, **kw), step_log=path)
    return read_step_log(path)


def test_prefill_first_never_mixes_phases_and_chunked_does(tmp_path):
    prefill_first = _step_log(tmp_path, "prefill-first", None)
    assert {r.lane for r in prefill_first} == {"prefill", "decode"}
    assert all(r.prefill_tokens == 0 or r.decode_rows == 0 for r in prefill_first)
    chunked = _step_log(tmp_path, "chunked", 512)
    assert any(r.lane == "hybrid" for r in chunked)
    assert all(r.tokens <= 512 for r in chunked)


@pytest.mark.parametrize(("policy", "chunk"), [("prefill-first", None), ("chunked", 512)])
def test_a_single_lane_step_log_state_is_the_one_predicted(tmp_path, policy, chunk):
    config = _config(policy, chunk, noise=0.0)
    perf = setup(config).perf
    steps = _step_log(tmp_path, policy, chunk, noise=0.0)
    for r in steps:
        es = r.state
        prediction = perf.predict(es)
        phase_s = prediction.decode_s if r.lane == "decode" else prediction.prefill_s
        assert phase_s == pytest.approx(r.predicted_s, rel=1e-12)
        assert es.prefill_tokens + (es.decode_batch if r.lane == "decode" else 0) == r.tokens


def test_bullet_lanes_overlap_and_time_integrates_exactly(tmp_path):
    # Fusing off: on the A100 preset (bandwidth scaling with SMs, co-running zero-sum) nearly
    # every prompt rides in a fused step and the lanes would seldom run side by side.
    steps = _step_log(tmp_path, "bullet", None, noise=0.0, request_rates=(40.0,), fuse_decode=False)
    for r in steps:
        assert r.measured_s == pytest.approx(r.predicted_s, rel=1e-9)
        assert r.split[0] + r.split[1] <= 108 or r.split == (108, 108)
        assert r.rule in RULE_NAMES
        # The split logged is the one the step started under: the lane ran on its share of it
        # (a lane whose share is 0 does not start).
        share = r.split[0] if r.lane == "prefill" else r.split[1]
        assert share > 0 and r.units == share
        # The state logged is the lanes' when the step started: this lane's batch on its share.
        es = r.state
        if r.lane == "prefill":
            assert (es.prefill_tokens, es.prefill_units) == (r.tokens, share)
        else:
            assert (es.decode_batch, es.decode_units) == (r.batch_size, share)
    spans = {
        lane: [(r.time - r.measured_s, r.time) for r in steps if r.lane == lane]
        for lane in ("prefill", "decode")
    }
    overlaps = sum(
        1 for ps, pe in spans["prefill"] for ds, de in spans["decode"] if ds < pe and ps < de
    )
    assert overlaps > 0


@pytest.mark.parametrize("device", ["cpu", "a100", "a100-long"])
def test_bullet_fuses_decode_rows_into_prefill_steps(tmp_path, device):
    """On a 2-thread CPU profile where co-running is zero-sum, and on the A100 preset (whose
    bandwidth scales with SMs, so sharing the SMs is zero-sum too), prefill steps carry the
    decode rows as the engine's do: each such step runs alone, for exactly what the model
    predicts of its fused batch (on the GPU within the TPOT budget, or the longer limit while
    TTFT misses and TPOT holds; on the CPU chunked prefill's plan while TPOT holds), and every
    request still
    finishes with every block back. With arxiv-sum-like prompts (thousands of tokens), too long
    for one fused step within the budget, the prompts ride in chunks, each on top of the KV of
    the chunks before it."""
    from bulletserve.perf.hardware import HardwareProfile

    if device == "cpu":
        profile = tmp_path / "cpu.json"
        HardwareProfile("cpu", "cpu", True, 2, 1, 1, {"float32": 1e11}, 2e10, 2, 1e-4).save(profile)
        config = _config(
            "bullet",
            hardware=str(profile),
            model="smollm2-135m",
            dtype="float32",
            num_prompts=40,
            request_rates=(2.0,),
            slo=SLO(50.0, 500.0),
            noise=0.0,
            num_gpu_blocks_override=4000,
        )
    elif device == "a100":
        config = _config("bullet", num_prompts=40, request_rates=(20.0,), noise=0.0)
    else:
        config = _config(
            "bullet", dataset="arxiv-sum-like", num_prompts=40, request_rates=(3.0,), noise=0.0
        )
    perf = setup(config).perf
    path = tmp_path / "steps.jsonl"
    result = simulate(config, step_log=path)
    steps = read_step_log(path)
    fused = [r for r in steps if r.rule in ("fused", "fused-ttft-first", "chunked-plan")]
    assert fused and all(r.lane == "prefill" and r.decode_rows > 0 for r in fused)
    for r in fused:
        es = r.state
        assert not es.has_decode and es.prefill_tokens == r.tokens
        assert es.prefill_lens[-r.decode_rows :] == (1,) * r.decode_rows
        assert r.measured_s == pytest.approx(perf.predict(es).prefill_s, rel=1e-9)
        if r.rule == "fused-ttft-first":
            late_limit = BulletParams().late_fused_step_limit
            assert r.measured_s <= config.slo.tpot_ms / 1000 * late_limit
        elif device != "cpu":
            assert r.measured_s <= config.slo.tpot_ms / 1000 * 0.8
        start = r.time - r.measured_s
        assert not any(
            d.lane == "decode" and d.time - d.measured_s < r.time and start < d.time for d in steps
        )
    # A chunk on top of earlier ones: the step's first prompt has tokens in the cache.
    continued = [r for r in fused if r.state.prefill_cached[0] > 0]
    if device == "a100-long":
        assert continued
    (run,) = result.to_json()["runs"]
    assert all(req["error"] is None for req in run["requests"])
    assert len(run["requests"]) == 40


def test_kv_capacity_is_device_memory_minus_weights():
    from bulletserve.model.presets import PRESETS

    cfg = PRESETS["llama-3.1-8b"]
    blocks = kv_cache_blocks(cfg, "bfloat16", 16, DEVICE_MEMORY["A100-80GB-SXM"])
    expected = (0.9 * 80 * GIB - 2 * cfg.num_parameters()) // (2 * 32 * 8 * 128 * 2 * 16)
    assert blocks == expected
    with pytest.raises(SimSetupError, match="no KV cache"):
        kv_cache_blocks(PRESETS["llama-3.1-70b"], "bfloat16", 16, DEVICE_MEMORY["A100-80GB-SXM"])


def test_hardware_aliases_and_unknown_memory(tmp_path):
    assert load_hardware("a100-80g").name == load_hardware("a100-80gb").name == "A100-80GB-SXM"
    assert load_hardware("h100").name == "H100-SXM"
    profile = load_hardware("h20").to_dict() | {"name": "my-gpu"}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(SimSetupError, match="device-memory-gib"):
        setup(_config("chunked", 512, hardware=str(path)))
    assert setup(_config("chunked", 512, hardware=str(path), device_memory_gib=96)).num_blocks > 0


def test_the_simulated_gpu_keeps_the_partitioner_s_floor_on_a_remainder(tmp_path):
    """The simulator's unit space is the engine's: on a GPU no lane runs on fewer SMs than the
    green-context partitioner allows beside a carved group (partition/limits.py), so a
    simulated split is one the server could run."""
    from bulletserve.partition.limits import gpu_min_remainder

    config = _config("bullet", num_prompts=60, request_rates=(30.0,), fuse_decode=False)
    env = setup(config)
    policy = make_sim_policy(config, env)
    assert policy.units.min_remainder == gpu_min_remainder(env.perf.hw.units) == 43
    path = tmp_path / "steps.jsonl"
    simulate(config, step_log=path)
    splits = {tuple(json.loads(line)["split"]) for line in path.read_text().splitlines()}
    assert any(0 < prefill < policy.units.total for prefill, _ in splits)
    assert all(policy.units.is_valid(p) and policy.units.is_valid(d) for p, d in splits)
