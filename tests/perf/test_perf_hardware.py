"""Hardware profiles: JSON round trip, validation messages, datasheet presets."""

from __future__ import annotations

import json

import pytest

from bulletserve.perf.hardware import (
    PRESET_FILES,
    Calibration,
    HardwareProfile,
    ProfileError,
    UnitPoint,
    load_preset,
)


def _profile() -> HardwareProfile:
    return HardwareProfile(
        name="test-cpu",
        kind="cpu",
        measured=True,
        units=2,
        unit_granularity=1,
        min_units=1,
        peak_flops={"bfloat16": 2e11, "float32": 1e11},
        peak_bandwidth=3e10,
        bandwidth_saturation_units=1,
        step_overhead_s=1e-4,
        calibration=Calibration(
            alpha={"prefill": {1: ((16.0, 2.0), (256.0, 1.5)), 2: ((16.0, 2.5),)}},
            decode_bandwidth_corun=((1.0, 2e10),),
            unit_sweep=(UnitPoint(1, 1e11, 2e10), UnitPoint(2, 2e11, 3e10)),
            sampling_s_per_logit=((1.0, 3e-9), (2.0, 1.5e-9)),
            host_s_per_step=1.2e-3,
            host_s_per_row=4e-5,
        ),
        sources=("measured here",),
    )


def test_round_trip(tmp_path):
    prof = _profile()
    path = tmp_path / "p.json"
    prof.save(path)
    assert HardwareProfile.load(path) == prof


def test_a_profile_without_host_terms_has_none(tmp_path):
    raw = _profile().to_dict()
    del raw["calibration"]["host_s_per_step"], raw["calibration"]["host_s_per_row"]
    path = tmp_path / "older.json"
    path.write_text(json.dumps(raw))
    calibration = HardwareProfile.load(path).calibration
    assert calibration.host_s_per_step == calibration.host_s_per_row == 0.0


@pytest.mark.parametrize("name", sorted(PRESET_FILES))
def test_presets_load_and_are_not_measured(name):
    prof = load_preset(name)
    assert prof.kind == "gpu" and not prof.measured
    assert prof.unit_granularity == prof.min_units or name == "a100-80gb"
    assert prof.sources and HardwareProfile.from_dict(prof.to_dict()) == prof


def test_hopper_splits_in_eights():
    units = load_preset("h100-sxm").valid_units()
    assert units[0] == 8 and all(u % 8 == 0 for u in units[:-1]) and units[-1] == 132


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.pop("peak_bandwidth"), "peak_bandwidth"),
        (lambda d: d.update(units=0), "units"),
        (lambda d: d.update(kind="tpu"), "kind"),
        (lambda d: d["peak_flops"].update(bfloat16="fast"), "peak_flops.bfloat16"),
        (lambda d: d.update(gemm_tile=[128]), "gemm_tile"),
        (lambda d: d["calibration"]["alpha"]["prefill"].update({"1": [[16, -1]]}), "prefill.1"),
        (lambda d: d["calibration"]["alpha"].update(warmup={"1": [[1, 1]]}), "alpha.warmup"),
        (lambda d: d["calibration"]["unit_sweep"][0].pop("bandwidth"), "unit_sweep[0].bandwidth"),
        (lambda d: d["calibration"].update(sampling_s_per_logit=[[1, 0]]), "sampling_s_per_logit"),
        (lambda d: d["calibration"].update(host_s_per_row=-1e-4), "calibration.host_s_per_row"),
        (lambda d: d["calibration"].update(host_s_per_step="1 ms"), "calibration.host_s_per_step"),
    ],
)
def test_malformed_profile_names_the_field(tmp_path, edit, field):
    raw = _profile().to_dict()
    edit(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        HardwareProfile.load(path)


def test_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        HardwareProfile.load(path)
