"""Hardware profiles: what the roofline needs to know about a device, as a JSON file.

A profile is either a datasheet preset (`"measured": false`) or the output of
`bullet profile` (`"measured": true`). Calibration tables map a phase to its alpha points:
`{"prefill": {"<units>": [[tokens, alpha], ...]}, ...}` where tokens are the phase's rows (prefill
tokens or decode batch size). Phases `prefill_corun` and `decode_corun` hold the points
measured with the other lane running at the same time. Decode phases may also carry one table
per measured context length, keyed `decode@<context>` (and `decode_corun@<context>`): a decode
step's cost depends on its context as well as its batch. A co-running phase's alpha is measured
at one load of the other lane; `corun_load` scales it by the other lane's load:
`{"prefill": {"<units>": [[other lane's rows, factor], ...]}, "decode": {...}}`.
`sampling_s_per_logit` is the engine's sampler cost, `[[units, seconds per row per vocabulary
entry], ...]`: a step that ends in logits pays it for each of its rows. `host_s_per_step` and
`host_s_per_row` are the engine's own time around a step, outside the model and the sampler
(scheduling, detokenizing, handing outputs over): a step costs `host_s_per_step` plus
`host_s_per_row` for each sequence it samples. `all_reduce_s` is a tensor-parallel all-reduce's
time among the devices of one node, `{"<ranks>": [[bytes, seconds], ...]}`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

KINDS = ("gpu", "cpu")
PHASES = ("prefill", "decode", "prefill_corun", "decode_corun")
PRESET_FILES = {
    "a100-80gb": "a100_80gb.json",
    "h100-sxm": "h100_sxm.json",
    "h200": "h200.json",
    "h20": "h20.json",
}

Points = tuple[tuple[float, float], ...]


class ProfileError(ValueError):
    """A hardware profile file is malformed; the message names the field."""


@dataclass(frozen=True)
class UnitPoint:
    """Measured peak GEMM rate (FLOP/s) and memory bandwidth (bytes/s) at one unit count."""

    units: int
    gemm_flops: float
    bandwidth: float


@dataclass(frozen=True)
class Calibration:
    """alpha[phase][units] = sorted (tokens, alpha) points; corun_load[phase][units] = sorted
    (other lane's rows, factor on the co-running alpha) points; contention-adjusted decode
    bandwidth as (decode units, bytes/s) points; the unit sweep the profile was built from;
    the sampler's seconds per logit (row x vocabulary entry) as (units, seconds) points; the
    engine's host seconds per step and per sampled row (0: not measured); an all-reduce's
    seconds by ranks, as (bytes, seconds) points."""

    alpha: dict[str, dict[int, Points]] = field(default_factory=dict)
    corun_load: dict[str, dict[int, Points]] = field(default_factory=dict)
    decode_bandwidth_corun: Points = ()
    unit_sweep: tuple[UnitPoint, ...] = ()
    sampling_s_per_logit: Points = ()
    host_s_per_step: float = 0.0
    host_s_per_row: float = 0.0
    all_reduce_s: dict[int, Points] = field(default_factory=dict)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str  # "gpu" (units are SMs) or "cpu" (units are intra-op threads)
    measured: bool
    units: int  # N
    unit_granularity: int
    min_units: int
    peak_flops: dict[str, float]  # dtype name -> FLOP/s on all N units
    peak_bandwidth: float  # bytes/s
    bandwidth_saturation_units: int  # N_d
    step_overhead_s: float
    gemm_tile: tuple[int, int] | None = None  # (rows, cols) of a GEMM tile; None: no waves
    calibration: Calibration = field(default_factory=Calibration)
    sources: tuple[str, ...] = ()

    def valid_units(self) -> list[int]:
        """Every unit count a lane may get: min_units, then multiples of the granularity."""
        g = self.unit_granularity
        counts = range(math.ceil(self.min_units / g) * g, self.units + 1, g)
        return sorted({c for c in counts if c >= self.min_units} | {self.units})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gemm_tile"] = list(self.gemm_tile) if self.gemm_tile else None
        out["calibration"] = {
            "alpha": {
                phase: {str(u): [list(p) for p in pts] for u, pts in table.items()}
                for phase, table in self.calibration.alpha.items()
            },
            "corun_load": {
                phase: {str(u): [list(p) for p in pts] for u, pts in table.items()}
                for phase, table in self.calibration.corun_load.items()
            },
            "decode_bandwidth_corun": [list(p) for p in self.calibration.decode_bandwidth_corun],
            "unit_sweep": [asdict(p) for p in self.calibration.unit_sweep],
            "sampling_s_per_logit": [list(p) for p in self.calibration.sampling_s_per_logit],
            "host_s_per_step": self.calibration.host_s_per_step,
            "host_s_per_row": self.calibration.host_s_per_row,
            "all_reduce_s": {
                str(ranks): [list(p) for p in pts]
                for ranks, pts in self.calibration.all_reduce_s.items()
            },
        }
        out["sources"] = list(self.sources)
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, raw: Any) -> HardwareProfile:
        d = _Fields(raw, "profile")
        kind = d.get("kind", str)
        if kind not in KINDS:
            raise ProfileError(f"field 'kind': expected one of {KINDS}, got {kind!r}")
        units = d.positive_int("units")
        peak = _Fields(d.get("peak_flops", dict), "peak_flops")
        if not peak.raw:
            raise ProfileError("field 'peak_flops': needs at least one dtype")
        tile = d.get("gemm_tile", (list, type(None)))
        if tile is not None and (len(tile) != 2 or not all(_is_pos_int(t) for t in tile)):
            raise ProfileError(f"field 'gemm_tile': expected [rows, cols] or null, got {tile!r}")
        sources = d.get("sources", list)
        return cls(
            name=d.get("name", str),
            kind=kind,
            measured=d.get("measured", bool),
            units=units,
            unit_granularity=d.positive_int("unit_granularity"),
            min_units=d.positive_int("min_units"),
            peak_flops={k: peak.positive(k) for k in peak.raw},
            peak_bandwidth=d.positive("peak_bandwidth"),
            bandwidth_saturation_units=d.positive_int("bandwidth_saturation_units"),
            step_overhead_s=d.non_negative("step_overhead_s"),
            gemm_tile=(int(tile[0]), int(tile[1])) if tile else None,
            calibration=_calibration(d.get("calibration", dict)),
            sources=tuple(str(s) for s in sources),
        )

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON: {exc}") from None
        try:
            return cls.from_dict(raw)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from None


def load_preset(name: str) -> HardwareProfile:
    """A datasheet preset by name (see PRESET_FILES)."""
    try:
        fname = PRESET_FILES[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware preset {name!r}; known: {', '.join(PRESET_FILES)}"
        ) from None
    text = resources.files("bulletserve.perf").joinpath("presets", fname).read_text()
    return HardwareProfile.from_dict(json.loads(text))


def _is_pos_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _Fields:
    """Typed access to a JSON object; errors name the dotted field path."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, dict):
            raise ProfileError(f"field '{path}': expected an object, got {type(raw).__name__}")
        self.raw, self.path = raw, path

    def _name(self, key: str) -> str:
        return key if self.path == "profile" else f"{self.path}.{key}"

    def get(self, key: str, types: type | tuple[type, ...]) -> Any:
        if key not in self.raw:
            raise ProfileError(f"field '{self._name(key)}' is missing")
        value = self.raw[key]
        if not isinstance(value, types):
            raise ProfileError(f"field '{self._name(key)}': wrong type {type(value).__name__}")
        return value

    def number(self, key: str) -> float:
        value = self.raw.get(key)
        if key not in self.raw:
            raise ProfileError(f"field '{self._name(key)}' is missing")
        if not _is_number(value):
            raise ProfileError(f"field '{self._name(key)}': expected a number, got {value!r}")
        return float(value)

    def positive(self, key: str) -> float:
        value = self.number(key)
        if value <= 0:
            raise ProfileError(f"field '{self._name(key)}': must be > 0, got {value!r}")
        return value

    def non_negative(self, key: str) -> float:
        value = self.number(key)
        if value < 0:
            raise ProfileError(f"field '{self._name(key)}': must be >= 0, got {value!r}")
        return value

    def positive_int(self, key: str) -> int:
        value = self.raw.get(key)
        if not _is_pos_int(value):
            raise ProfileError(f"field '{self._name(key)}': expected a positive integer")
        return int(value)


def _points(raw: Any, path: str) -> Points:
    if not isinstance(raw, list) or not raw:
        raise ProfileError(f"field '{path}': expected a non-empty list of [x, y] points")
    pts = []
    for p in raw:
        if not (isinstance(p, list) and len(p) == 2 and all(_is_number(v) for v in p)):
            raise ProfileError(f"field '{path}': bad point {p!r}, expected [x, y]")
        if p[0] <= 0 or p[1] <= 0:
            raise ProfileError(f"field '{path}': point {p!r} must be positive")
        pts.append((float(p[0]), float(p[1])))
    pts.sort()
    if len({x for x, _ in pts}) != len(pts):
        raise ProfileError(f"field '{path}': duplicate x in {raw!r}")
    return tuple(pts)


def _calibration(raw: dict[str, Any]) -> Calibration:
    alpha: dict[str, dict[int, Points]] = {}
    for phase, table in _Fields(raw.get("alpha", {}), "calibration.alpha").raw.items():
        path = f"calibration.alpha.{phase}"
        base, _, context = phase.partition("@")
        if base not in PHASES:
            raise ProfileError(f"field '{path}': unknown phase; expected one of {PHASES}")
        if context and (not base.startswith("decode") or not context.isdigit()):
            raise ProfileError(
                f"field '{path}': only decode phases take '@<context>', a positive int"
            )
        alpha[phase] = _unit_table(table, path)
    corun_load: dict[str, dict[int, Points]] = {}
    for phase, table in _Fields(raw.get("corun_load", {}), "calibration.corun_load").raw.items():
        path = f"calibration.corun_load.{phase}"
        if phase not in ("prefill", "decode"):
            raise ProfileError(f"field '{path}': expected 'prefill' or 'decode'")
        corun_load[phase] = _unit_table(table, path)
    bw_raw = raw.get("decode_bandwidth_corun", [])
    bw = _points(bw_raw, "calibration.decode_bandwidth_corun") if bw_raw else ()
    sweep_raw = raw.get("unit_sweep", [])
    if not isinstance(sweep_raw, list):
        raise ProfileError("field 'calibration.unit_sweep': expected a list")
    sweep = []
    for j, p in enumerate(sweep_raw):
        f = _Fields(p, f"calibration.unit_sweep[{j}]")
        sweep.append(
            UnitPoint(f.positive_int("units"), f.positive("gemm_flops"), f.positive("bandwidth"))
        )
    sampling_raw = raw.get("sampling_s_per_logit", [])
    sampling = _points(sampling_raw, "calibration.sampling_s_per_logit") if sampling_raw else ()
    host = _Fields(raw, "calibration")
    return Calibration(
        alpha=alpha,
        corun_load=corun_load,
        decode_bandwidth_corun=bw,
        unit_sweep=tuple(sweep),
        sampling_s_per_logit=sampling,
        host_s_per_step=host.non_negative("host_s_per_step") if "host_s_per_step" in raw else 0.0,
        host_s_per_row=host.non_negative("host_s_per_row") if "host_s_per_row" in raw else 0.0,
        all_reduce_s=_unit_table(raw.get("all_reduce_s", {}), "calibration.all_reduce_s"),
    )


def _unit_table(raw: Any, path: str) -> dict[int, Points]:
    parsed: dict[int, Points] = {}
    for units, pts in _Fields(raw, path).raw.items():
        if not units.isdigit() or int(units) <= 0:
            raise ProfileError(f"field '{path}.{units}': unit count must be a positive int")
        parsed[int(units)] = _points(pts, f"{path}.{units}")
    return dict(sorted(parsed.items()))
