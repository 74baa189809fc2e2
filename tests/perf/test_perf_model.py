"""The roofline at its limits, alpha interpolation, contention, online correction, speed."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bulletserve.model.presets import PRESETS
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.hardware import Calibration, load_preset
from bulletserve.perf.model import PerfModel

H100 = load_preset("h100-sxm")
UNCALIBRATED = dataclasses.replace(H100, calibration=Calibration())
LLAMA = PRESETS["llama-3.1-8b"]


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 4096), min_size=1, max_size=4),
    ctx=st.lists(st.integers(1, 8192), min_size=1, max_size=64),
    units=st.sampled_from(H100.valid_units()[:-1]),
)
def test_more_units_never_slower(lens, ctx, units):
    model = PerfModel(LLAMA, UNCALIBRATED)
    more = units + 8
    for phase, es_of in (
        ("prefill", lambda u: ExecutionState(prefill_lens=tuple(lens), prefill_units=u)),
        ("decode", lambda u: ExecutionState(decode_ctx=tuple(ctx), decode_units=u)),
    ):
        assert model.roofline(es_of(more), phase) <= model.roofline(es_of(units), phase) * (
            1 + 1e-12
        )


def test_decode_bandwidth_flat_beyond_n_d():
    # A memory-bound decode step: time stops improving once N_p >= N_d.
    hw = dataclasses.replace(UNCALIBRATED, bandwidth_saturation_units=48)
    model = PerfModel(LLAMA, hw)
    times = {
        u: model.roofline(ExecutionState(decode_ctx=(1024,) * 8, decode_units=u), "decode")
        for u in (8, 24, 48, 96, 132)
    }
    assert times[8] > times[24] > times[48]
    assert times[48] == pytest.approx(times[96]) == pytest.approx(times[132])


def test_compute_bound_prefill_scales_with_units():
    model = PerfModel(LLAMA, UNCALIBRATED)
    t = {
        u: model.roofline(ExecutionState(prefill_lens=(8192,), prefill_units=u), "prefill")
        for u in (64, 128)
    }
    assert t[64] / t[128] == pytest.approx(2.0, rel=0.05)


def test_alpha_exact_on_measured_points_and_between():
    table = {16: ((64.0, 2.0), (1024.0, 1.4)), 64: ((64.0, 1.6), (1024.0, 1.2))}
    hw = dataclasses.replace(H100, calibration=Calibration(alpha={"prefill": table}))
    model = PerfModel(LLAMA, hw)
    for units, pts in table.items():
        for tokens, alpha in pts:
            es = ExecutionState(prefill_lens=(int(tokens),), prefill_units=units)
            assert model.alpha(es, "prefill") == alpha
            assert model.predict(es).prefill_s == pytest.approx(
                alpha * model.roofline(es, "prefill")
            )
    mid = model.alpha(ExecutionState(prefill_lens=(256,), prefill_units=40), "prefill")
    assert 1.2 < mid < 2.0
    # Beyond the table: the nearest edge.
    assert model.alpha(ExecutionState(prefill_lens=(8,), prefill_units=8), "prefill") == 2.0


def test_preset_alpha_from_vidur_applies_at_full_width():
    model = PerfModel(LLAMA, H100)
    es = ExecutionState(decode_ctx=(512,) * 4, decode_units=132)
    assert model.alpha(es, "decode") == dict(H100.calibration.alpha["decode"][132])[4.0]


def test_co_running_decode_sees_contended_bandwidth_and_corun_alpha():
    cal = Calibration(
        alpha={"decode": {132: ((8.0, 1.0),)}, "decode_corun": {132: ((8.0, 1.5),)}},
        decode_bandwidth_corun=((8.0, 1e12), (132.0, 2e12)),
    )
    model = PerfModel(LLAMA, dataclasses.replace(UNCALIBRATED, calibration=cal))
    alone = ExecutionState(decode_ctx=(2048,) * 8, decode_units=132)
    both = dataclasses.replace(alone, prefill_lens=(1024,), prefill_units=132)
    assert model.roofline(both, "decode", corun=True) > model.roofline(alone, "decode")
    assert model.alpha(both, "decode", corun=True) == 1.5
    assert model.predict(both).decode_s > 1.5 * model.predict(alone).decode_s


def test_a_step_that_reaches_the_lm_head_pays_the_sampler_for_each_row():
    cal = Calibration(sampling_s_per_logit=((8.0, 4e-10), (132.0, 1e-10)))
    model = PerfModel(LLAMA, dataclasses.replace(UNCALIBRATED, calibration=cal))
    bare = PerfModel(LLAMA, UNCALIBRATED)  # the datasheet presets measure no sampler
    per_row = LLAMA.vocab_size * 1e-10
    decode = ExecutionState(decode_ctx=(500,) * 16, decode_units=132)
    assert model.predict(decode).decode_s - bare.predict(decode).decode_s == pytest.approx(
        16 * per_row
    )
    narrow = dataclasses.replace(decode, decode_units=8)
    assert model.sampling_s(narrow, "decode") == pytest.approx(16 * LLAMA.vocab_size * 4e-10)
    # A prefill layer group samples only when it runs the last layer: a row per prompt.
    first = ExecutionState(
        prefill_lens=(300, 200), prefill_units=132, prefill_layers=8, prefill_first_layer=0
    )
    last = dataclasses.replace(first, prefill_first_layer=LLAMA.num_layers - 8)
    assert model.sampling_s(first, "prefill") == 0.0
    assert model.sampling_s(last, "prefill") == pytest.approx(2 * per_row)
    assert model.predict(first).prefill_s == bare.predict(first).prefill_s


def test_host_time_is_per_step_and_per_row_and_not_in_the_step_prediction():
    cal = Calibration(host_s_per_step=1e-3, host_s_per_row=5e-5)
    model = PerfModel(LLAMA, dataclasses.replace(UNCALIBRATED, calibration=cal))
    bare = PerfModel(LLAMA, UNCALIBRATED)
    assert model.host_s(0) == pytest.approx(1e-3)
    assert model.host_s(16) == pytest.approx(1e-3 + 16 * 5e-5)
    assert bare.host_s(16) == 0.0
    # The engine times the model alone, and the online correction compares with that.
    decode = ExecutionState(decode_ctx=(500,) * 16, decode_units=132)
    assert model.predict(decode) == bare.predict(decode)


def test_online_correction_tracks_drift():
    model = PerfModel(LLAMA, H100, correction_weight=0.2)
    es = ExecutionState(prefill_lens=(2048,), prefill_units=64)
    truth = 1.3 * model.predict(es).prefill_s
    for _ in range(40):
        model.observe(es, "prefill", truth)
    assert model.predict(es).prefill_s == pytest.approx(truth, rel=0.01)
    assert model.corrections.decode == 1.0
    model.observe(es, "prefill", 1e3 * truth)  # an outlier is ignored
    assert model.predict(es).prefill_s == pytest.approx(truth, rel=0.01)


def test_a_cold_model_converges_per_size_bucket_within_a_few_steps():
    """A device the model misjudges by a different factor for small and large steps (a cold
    server's quick roofline against a CPU's real speeds): after five steps of each size, every
    size's prediction is within 10% of its measured time, and a size never seen takes the
    phase's correction."""
    model = PerfModel(LLAMA, H100)
    truth = {16: 3.0, 256: 1.8, 2048: 0.6}  # measured over predicted, by prompt tokens
    states = {n: ExecutionState(prefill_lens=(n,), prefill_units=132) for n in truth}
    uncorrected = {n: model.predict(es).prefill_s for n, es in states.items()}
    for _ in range(5):
        for n, es in states.items():
            model.observe(es, "prefill", truth[n] * uncorrected[n])
    for n, es in states.items():
        assert model.predict(es).prefill_s == pytest.approx(truth[n] * uncorrected[n], rel=0.1)
    unseen = ExecutionState(prefill_lens=(64,), prefill_units=132)
    assert model.predict(unseen).prefill_s == pytest.approx(
        model.corrections.prefill * model.uncorrected(unseen).prefill_s
    )
    model.reset_corrections()
    assert model.predict(states[16]).prefill_s == uncorrected[16]


def test_co_running_steps_learn_a_factor_on_top_of_the_drift():
    """Steps alone track the machine's drift; co-running steps only what the profile's
    co-running points miss beyond it, so a run of steps alone does not erase it."""
    model = PerfModel(LLAMA, H100, correction_weight=0.2)
    alone = ExecutionState(prefill_lens=(2048,), prefill_units=64)
    beside = dataclasses.replace(alone, decode_ctx=(300,) * 16, decode_units=68)
    alone_truth = 1.2 * model.predict(alone).prefill_s
    beside_truth = 1.2 * 1.1 * model.predict(beside).prefill_s
    for _ in range(40):
        model.observe(alone, "prefill", alone_truth)
        model.observe(beside, "prefill", beside_truth)
    assert model.predict(alone).prefill_s == pytest.approx(alone_truth, rel=0.01)
    assert model.predict(beside).prefill_s == pytest.approx(beside_truth, rel=0.01)
    assert model.corrections.corun_prefill == pytest.approx(1.1, rel=0.01)
    assert model.corrections.corun_decode == 1.0


def test_idle_lanes_and_missing_units():
    model = PerfModel(LLAMA, H100)
    assert model.predict(ExecutionState()).step_s == 0.0
    with pytest.raises(ValueError, match="decode_units"):
        model.predict(ExecutionState(decode_ctx=(5,)))
    with pytest.raises(ValueError, match="peak FLOP/s"):
        PerfModel(LLAMA, dataclasses.replace(H100, peak_flops={"float32": 1e12}))


def test_predict_under_50_microseconds():
    model = PerfModel(LLAMA, H100)
    es = ExecutionState(
        prefill_lens=(512, 1024),
        prefill_cached=(0, 256),
        prefill_units=96,
        decode_ctx=tuple(range(100, 164)),
        decode_units=36,
    )
    n, best = 2000, float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            model.predict(es)
        best = min(best, (time.perf_counter() - start) / n)
    assert best < 50e-6, f"predict took {best * 1e6:.1f} us"


@pytest.mark.parametrize("hw", [H100, dataclasses.replace(H100, kind="cpu", gemm_tile=None)])
def test_op_breakdown_sums_to_roofline(hw):
    model = PerfModel(LLAMA, hw)
    es = ExecutionState(
        prefill_lens=(100, 700),
        prefill_cached=(50, 0),
        prefill_units=40,
        decode_ctx=(10, 2000, 333),
        decode_units=16,
    )
    for phase in ("prefill", "decode"):
        breakdown = model.op_breakdown(es, phase)
        assert "attention" in breakdown and "lm_head" in breakdown
        assert sum(breakdown.values()) == pytest.approx(model.roofline(es, phase), rel=1e-12)


def test_gpu_steps_script_predicts_each_measured_step_of_the_device_check():
    import importlib.util
    import json
    from pathlib import Path

    from bulletserve.model.presets import get_preset
    from bulletserve.perf.execution_state import ExecutionState
    from bulletserve.perf.model import PerfModel
    from bulletserve.sim.device_presets import load_hardware

    root = Path(__file__).parents[2]
    spec = importlib.util.spec_from_file_location(
        "gpu_steps_vs_model", root / "benchmarks" / "gpu_steps_vs_model.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    steps = json.loads((root / "tests/fixtures/h200-device-check.json").read_text())["steps"]
    perf = PerfModel(get_preset("llama-3.1-8b"), load_hardware("h200"), "bfloat16")
    rows = script.rows(steps, perf, 2048, 32, 1024)
    assert len(rows) == 4 * len(steps)
    split, phase, measured, predicted = rows[0]
    assert (split, phase, measured) == (steps[0]["split_P/D"], "prefill_ms", steps[0]["prefill_ms"])
    units = int(split.split("/")[0])
    es = ExecutionState(prefill_lens=(2048,), prefill_units=units)
    assert predicted == pytest.approx(perf.predict(es).prefill_s * 1e3)


def test_a_quantized_models_decode_reads_its_formats_bytes_and_prefill_computes_as_much():
    """Decode at batch 4 (memory-bound: the weights dominate what it reads) falls with the bits
    a weight takes; a long prefill (compute-bound but for its one LM-head row) hardly moves."""
    from bulletserve.perf.inventory import WEIGHT_FORMAT_BITS

    decode = ExecutionState(decode_ctx=(512,) * 4, decode_units=H100.units)
    prefill = ExecutionState(prefill_lens=(4096,), prefill_units=H100.units)
    plain = PerfModel(LLAMA, UNCALIBRATED)
    times = {None: plain.roofline(decode, "decode")}
    for name in ("q8_0", "q6_k", "q4_k"):
        model = PerfModel(LLAMA, UNCALIBRATED, weight_bits=WEIGHT_FORMAT_BITS[name])
        times[name] = model.roofline(decode, "decode")
        at_prefill = model.roofline(prefill, "prefill")
        assert at_prefill == pytest.approx(plain.roofline(prefill, "prefill"), rel=0.01)
    assert times[None] > times["q8_0"] > times["q6_k"] > times["q4_k"]
    # bf16's 16 bits against Q4_K's 4.5: the step shrinks by nearly that ratio (the KV cache
    # and activations it also reads do not)
    assert 2.5 < times[None] / times["q4_k"] < 16 / 4.5
    with pytest.raises(ValueError, match="weight_bits"):
        PerfModel(LLAMA, UNCALIBRATED, weight_bits=0)
