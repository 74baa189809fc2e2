"""Fitting a profile from measurements: N_d, alpha exact on the measured points."""

from __future__ import annotations

import dataclasses

import pytest

from bulletserve.model.presets import PRESETS
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.fit import StepSample, calibrate, saturation_units
from bulletserve.perf.hardware import HardwareProfile, ProfileError, UnitPoint
from bulletserve.perf.model import PerfModel

CFG = PRESETS["smollm2-135m"]
HW = HardwareProfile("cpu", "cpu", True, 4, 1, 1, {"bfloat16": 4e11}, 4e10, 2, 1e-4)


def test_saturation_units():
    sweep = [UnitPoint(1, 1, 10e9), UnitPoint(2, 1, 19e9), UnitPoint(4, 1, 20e9)]
    assert saturation_units(sweep) == 2


def test_calibrated_model_reproduces_its_samples():
    samples = []
    for units in (1, 2, 4):
        for n in (32, 256, 1024):
            es = ExecutionState(prefill_lens=(n,), prefill_units=units)
            samples.append(StepSample(es, "prefill", False, 0.01 * n / units + 0.002))
        for b in (1, 16):
            es = ExecutionState(decode_ctx=(300,) * b, decode_units=units)
            samples.append(StepSample(es, "decode", False, 0.003 * b + 0.01))
    both = ExecutionState(
        prefill_lens=(256,), prefill_units=2, decode_ctx=(300,) * 16, decode_units=2
    )
    samples += [StepSample(both, "prefill", True, 2.0), StepSample(both, "decode", True, 0.09)]
    hw = calibrate(CFG, HW, "bfloat16", samples, ((2.0, 1e10),))
    assert set(hw.calibration.alpha) == {
        "prefill",
        "decode",
        "prefill_corun",
        "decode_corun",
        "decode@300",
        "decode_corun@300",
    }
    model = PerfModel(CFG, hw)
    for s in samples:
        es = (
            s.es
            if s.corun
            else dataclasses.replace(
                s.es, **({"decode_ctx": ()} if s.phase == "prefill" else {"prefill_lens": ()})
            )
        )
        got = model.predict(es)
        assert getattr(got, f"{s.phase}_s") == pytest.approx(s.measured_s, rel=1e-9)
    assert HardwareProfile.from_dict(hw.to_dict()) == hw


def test_decode_alpha_follows_the_context_as_well_as_the_batch():
    """Same batches at two contexts with different costs: the per-context tables reproduce
    both (one table averaged over contexts could not), and a context between them lands
    between the two."""
    samples = []
    for ctx, per_seq in ((128, 0.001), (1024, 0.004)):
        for b in (1, 16):
            es = ExecutionState(decode_ctx=(ctx,) * b, decode_units=2)
            samples.append(StepSample(es, "decode", False, per_seq * b + 0.01))
    model = PerfModel(CFG, calibrate(CFG, HW, "bfloat16", samples, ((2.0, 1e10),)))
    for s in samples:
        assert model.predict(s.es).decode_s == pytest.approx(s.measured_s, rel=1e-9)
    middle = model.predict(ExecutionState(decode_ctx=(400,) * 16, decode_units=2)).decode_s
    low, high = (s.measured_s for s in samples if s.es.decode_batch == 16)
    assert low < middle < high


def test_context_tables_only_for_decode_phases():
    raw = HW.to_dict()
    raw["calibration"]["alpha"] = {"prefill@128": {"1": [[1, 1.0]]}}
    with pytest.raises(ProfileError, match="calibration.alpha.prefill@128"):
        HardwareProfile.from_dict(raw)


def test_corun_alpha_follows_the_other_lanes_load():
    """Co-running measured as a cross (own size varied at one load of the other lane, that load
    varied at one own size): every cross point is reproduced, and off the cross the other
    lane's load still moves the prediction the way it was measured to."""

    def prefill_s(n: int, batch: int) -> float:
        return 0.0004 * n * (1 + 0.02 * batch)

    def decode_s(batch: int, n: int) -> float:
        return (0.02 + 0.001 * batch) * (1 + n / 2048)

    samples = []
    cross = [(256, 16), (1024, 16), (4096, 16), (1024, 1), (1024, 64)]
    for n, b in cross:
        es = ExecutionState(
            prefill_lens=(n,), prefill_units=2, decode_ctx=(300,) * b, decode_units=2
        )
        samples += [
            StepSample(es, "prefill", True, prefill_s(n, b)),
            StepSample(es, "decode", True, decode_s(b, n)),
        ]
    hw = calibrate(CFG, HW, "bfloat16", samples, ((2.0, 1e10),))
    assert set(hw.calibration.corun_load) == {"prefill", "decode"}
    assert HardwareProfile.from_dict(hw.to_dict()) == hw
    model = PerfModel(CFG, hw)
    for s in samples:
        assert getattr(model.predict(s.es), f"{s.phase}_s") == pytest.approx(s.measured_s)

    def predict(n: int, b: int):
        es = ExecutionState(
            prefill_lens=(n,), prefill_units=2, decode_ctx=(300,) * b, decode_units=2
        )
        return model.predict(es)

    assert predict(256, 1).prefill_s < predict(256, 16).prefill_s < predict(256, 64).prefill_s
    assert predict(256, 64).decode_s < predict(4096, 64).decode_s


def test_corun_load_only_for_the_two_phases():
    raw = HW.to_dict()
    raw["calibration"]["corun_load"] = {"prefill_corun": {"1": [[1, 1.0]]}}
    with pytest.raises(ProfileError, match="calibration.corun_load.prefill_corun"):
        HardwareProfile.from_dict(raw)
