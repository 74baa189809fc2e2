"""The calibrated SM-scaling roofline: step-time predictions for both lanes.

For a phase on N_p of the device's N units,

    T' = sum_k flop_k / min(flop_k / bytes_k * D_p, C_p),
    C_p = C_peak * N_p / N,    D_p = D_peak * min(1, N_p / N_d),

where a GPU GEMM's C_p is further scaled by its wave efficiency (tiles over units). The
prediction is `overhead + alpha(N_p, rows) * T' * correction`: alpha comes from the profile's
measured points for the phase (co-running points when the other lane is busy), and the online
correction is an EWMA of measured / predicted that `observe` updates from real steps: steps
alone set a phase's correction (the machine's drift), co-running steps a further factor on top
of it (what the profile's co-running points miss: served side-by-side steps ran 8-15% over
their corrected predictions on the 2-vCPU machine while steps alone were within 1-6%). A step
that reaches the LM head also pays the engine's sampler for each of its rows, at the profile's
measured cost per logit (0 where the profile has none, as the datasheet presets). A decode
step co-running with a prefill sees the profile's contention-adjusted bandwidth, and a co-running
alpha is scaled by the profile's load factor for the other lane's rows.

Under tensor parallelism over R ranks the roofline is one rank's: its share of the heads, the
MLP columns and the vocabulary (`ModelConfig.sharded`). Every layer adds two all-reduces of the
step's hidden states, and a step that reaches the LM head a gather of the logits (priced as an
all-reduce of the rank's share), at the profile's measured all-reduce time for R ranks.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, replace
from functools import cached_property

from bulletserve.model.config import ModelConfig
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.interp import AlphaSurface, Curve
from bulletserve.perf.inventory import (
    FIRST,
    LAST,
    LAYER,
    LOGIT_BYTES,
    SEQS,
    TOKENS,
    Counts,
    op_templates,
    phase_counts,
    phase_layers,
    step_ops,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PREDICT_PHASES = ("prefill", "decode")
# observe() ignores a single ratio outside this band (a stalled or mis-attributed step).
_RATIO_BAND = (0.1, 10.0)


def op_time(
    flops: float,
    nbytes: float,
    c_p: float,
    d_p: float,
    units: float,
    gemm_mn: tuple[float, int] | None = None,
    tile: tuple[int, int] | None = None,
) -> float:
    """flops / min(flops/bytes * D_p, C_p), with C_p scaled by the wave efficiency of a GEMM of
    gemm_mn = (rows, cols) tiled by `tile` over `units` units."""
    if gemm_mn is not None and tile is not None:
        tiles = math.ceil(gemm_mn[0] / tile[0]) * math.ceil(gemm_mn[1] / tile[1])
        c_p = c_p * tiles / (math.ceil(tiles / units) * units)
    return max(flops / c_p, nbytes / d_p)


@dataclass(frozen=True)
class StepPrediction:
    prefill_s: float
    decode_s: float

    @property
    def step_s(self) -> float:
        """Both lanes run at once: the step lasts as long as the slower one."""
        return max(self.prefill_s, self.decode_s)


def size_bucket(es: ExecutionState, phase: str) -> int:
    """The size class of `phase` of `es` for the online correction: log2 of its rows (a
    prefill's tokens, fused decode rows included; a decode's sequences), so that a model off by
    a different factor for small and large steps is corrected for each."""
    rows = sum(es.prefill_lens) if phase == "prefill" else es.decode_rows
    return max(rows, 1).bit_length() - 1


@dataclass(frozen=True)
class Corrections:
    """The online corrections at one moment: per phase, measured over predicted for steps
    alone, over all sizes and per size bucket (`size_bucket`; a bucket without observations
    takes the phase's), and a further factor for steps beside the other lane's. A value, so a
    policy can take them in its snapshot and predict exactly as the engine did when it
    planned."""

    prefill: float = 1.0
    decode: float = 1.0
    corun_prefill: float = 1.0
    corun_decode: float = 1.0
    # (phase, size bucket) -> measured over predicted, for the buckets observed
    buckets: tuple[tuple[tuple[str, int], float], ...] = ()

    @cached_property
    def _by_bucket(self) -> dict[tuple[str, int], float]:
        return dict(self.buckets)

    def factor(self, phase: str, corun: bool, bucket: int | None = None) -> float:
        alone = self.prefill if phase == "prefill" else self.decode
        if bucket is not None and self.buckets:
            alone = self._by_bucket.get((phase, bucket), alone)
        if not corun:
            return alone
        return alone * (self.corun_prefill if phase == "prefill" else self.corun_decode)


class PerfModel:
    """Predicts prefill and decode step times for one model on one device."""

    def __init__(
        self,
        cfg: ModelConfig,
        hw: HardwareProfile,
        dtype: str = "bfloat16",
        correction_weight: float = 0.1,
        tensor_parallel_size: int = 1,
        price_collectives: bool = True,
        weight_bits: float | None = None,
    ) -> None:
        """`price_collectives=False`: leave tensor parallelism's collectives out (a profile
        without all-reduce times for the ranks; the online correction takes them in).
        `weight_bits`: bits a GEMM weight takes where the weights are quantized (None: the
        dtype's)."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
        if dtype not in hw.peak_flops:
            raise ValueError(
                f"hardware profile {hw.name!r} has no peak FLOP/s for {dtype} (it has "
                f"{', '.join(hw.peak_flops)}; `bullet profile --dtype {dtype}` measures one)"
            )
        if not 0 < correction_weight <= 1:
            raise ValueError("correction_weight must be in (0, 1]")
        if weight_bits is not None and not 0 < weight_bits <= 32:
            raise ValueError(f"weight_bits must be in (0, 32], got {weight_bits}")
        self.cfg, self.hw, self.dtype = cfg, hw, dtype
        self.weight_bytes = None if weight_bits is None else weight_bits / 8
        self.tensor_parallel_size = tensor_parallel_size
        rank_cfg = replace(
            cfg.sharded(tensor_parallel_size),
            vocab_size=-(-cfg.vocab_size // tensor_parallel_size),
        )
        self._all_reduce = (
            _all_reduce_curve(hw, tensor_parallel_size) if price_collectives else None
        )
        self.correction_weight = correction_weight
        self.corrections = Corrections()
        # Observations so far per correction (phase, corun phase, or (phase, bucket)): the
        # first ones are averaged (weight 1/n) before the EWMA takes over, so a cold model
        # converges in a few steps of each kind.
        self._observed: dict[object, int] = {}
        self._c_peak = hw.peak_flops[dtype]
        self._tile = hw.gemm_tile if hw.kind == "gpu" else None
        # Per scope: (flop coeffs, byte coeffs, fixed bytes, gemm cols, gemm rows index).
        self._ops: dict[str, list[tuple[Counts, Counts, float, int, int]]] = {
            LAYER: [],
            FIRST: [],
            LAST: [],
        }
        for t in op_templates(rank_cfg, DTYPE_BYTES[dtype], self.weight_bytes):
            self._ops[t.scope].append((t.flops, t.bytes, t.fixed_bytes, t.gemm_n, t.gemm_rows))
        cal = hw.calibration
        self._alpha = {p: AlphaSurface.from_table(t) for p, t in cal.alpha.items() if t}
        # Decode phase -> (log contexts, surfaces) from the `decode@<context>` tables.
        by_context: dict[str, list[tuple[float, AlphaSurface]]] = {}
        for key, surface in self._alpha.items():
            base, _, context = key.partition("@")
            if context:
                by_context.setdefault(base, []).append((math.log(int(context)), surface))
        self._alpha_by_context = {}
        for base, pts in by_context.items():
            pts.sort(key=lambda item: item[0])
            self._alpha_by_context[base] = (tuple(x for x, _ in pts), tuple(s for _, s in pts))
        self._corun_load = {p: AlphaSurface.from_table(t) for p, t in cal.corun_load.items() if t}
        self._corun_bw = (
            Curve.from_points(cal.decode_bandwidth_corun, log_x=False)
            if cal.decode_bandwidth_corun
            else None
        )
        self._sampling_per_row = (
            Curve.from_points(
                tuple((u, s * cfg.vocab_size) for u, s in cal.sampling_s_per_logit), log_x=False
            )
            if cal.sampling_s_per_logit
            else None
        )

    def _check_units(self, units: int, phase: str) -> float:
        if units <= 0:
            raise ValueError(f"{phase} has work but {phase}_units is {units}")
        return float(min(units, self.hw.units))

    def roofline(self, es: ExecutionState, phase: str, corun: bool = False) -> float:
        """T' for `phase` of `es` in seconds: uncalibrated, without the fixed overhead."""
        return self._roofline(es, phase, phase_counts(es, phase), corun)

    def _roofline(self, es: ExecutionState, phase: str, counts: Counts, corun: bool) -> float:
        if counts[TOKENS] == 0:
            return 0.0
        units = self._check_units(
            es.prefill_units if phase == "prefill" else es.decode_units, phase
        )
        c_p, d_p = self._unit_rates(units)
        if corun and phase == "decode" and self._corun_bw is not None:
            d_p = self._corun_bw(units)
        layers, first, last = phase_layers(self.cfg, es, phase)
        total = layers * self._scope_time(LAYER, counts, c_p, d_p, units)
        if first:
            total += self._scope_time(FIRST, counts, c_p, d_p, units)
        if last:
            total += self._scope_time(LAST, counts, c_p, d_p, units)
        return total

    def _scope_time(
        self, scope: str, counts: Counts, c_p: float, d_p: float, units: float
    ) -> float:
        # op_time inlined: this loop is the hot path of predict (test_perf_model checks both agree).
        n0, n1, n2, n3 = counts
        tile = self._tile
        ceil = math.ceil
        total = 0.0
        for fl, by, fixed, gemm_n, rows in self._ops[scope]:
            flops = fl[0] * n0 + fl[1] * n1 + fl[2] * n2 + fl[3] * n3
            t_mem = (fixed + by[0] * n0 + by[1] * n1 + by[2] * n2 + by[3] * n3) / d_p
            if gemm_n and tile is not None:
                tiles = ceil(counts[rows] / tile[0]) * ceil(gemm_n / tile[1])
                t_comp = flops * ceil(tiles / units) * units / (c_p * tiles)
            else:
                t_comp = flops / c_p
            total += t_comp if t_comp > t_mem else t_mem
        return total

    def op_breakdown(self, es: ExecutionState, phase: str) -> dict[str, float]:
        """Roofline seconds of each op of `phase` (all its instances), alone on its units."""
        units = float(es.prefill_units if phase == "prefill" else es.decode_units)
        c_p, d_p = self._unit_rates(units)
        times = {}
        for op in step_ops(self.cfg, es, phase, DTYPE_BYTES[self.dtype], self.weight_bytes):
            gemm = (op.gemm_m, op.gemm_n) if op.gemm_n else None
            t = op_time(op.flops, op.bytes, c_p, d_p, units, gemm, self._tile)
            times[op.name] = op.repeat * t
        return times

    def _unit_rates(self, units: float) -> tuple[float, float]:
        """(C_p, D_p) on `units` units."""
        hw = self.hw
        return (
            self._c_peak * units / hw.units,
            hw.peak_bandwidth * min(1.0, units / hw.bandwidth_saturation_units),
        )

    def alpha(self, es: ExecutionState, phase: str, corun: bool = False) -> float:
        """The calibration factor for `phase` of `es` (1.0 where the profile has no points)."""
        return self._alpha_at(es, phase, phase_counts(es, phase)[TOKENS], corun)

    def _alpha_at(self, es: ExecutionState, phase: str, rows: float, corun: bool) -> float:
        key = f"{phase}_corun" if corun and f"{phase}_corun" in self._alpha else phase
        surface = self._alpha.get(key)
        if surface is None:
            return 1.0
        units = es.prefill_units if phase == "prefill" else es.decode_units
        if phase == "decode" and key in self._alpha_by_context:
            alpha = self._decode_alpha(key, units, rows, es.decode_ctx)
        else:
            alpha = surface(units, rows)
        load = self._corun_load.get(phase) if key != phase else None
        if load is not None:
            other = "decode" if phase == "prefill" else "prefill"
            alpha *= load(units, phase_counts(es, other)[TOKENS])
        return alpha

    def _decode_alpha(self, key: str, units: int, rows: float, contexts: tuple[int, ...]) -> float:
        """alpha between the two measured contexts nearest the mean (log-linear), clamped."""
        xs, surfaces = self._alpha_by_context[key]
        x = math.log(max(sum(contexts) / len(contexts), 1.0))
        if x <= xs[0]:
            return surfaces[0](units, rows)
        if x >= xs[-1]:
            return surfaces[-1](units, rows)
        j = bisect_right(xs, x)
        lo, hi = surfaces[j - 1](units, rows), surfaces[j](units, rows)
        return lo + (hi - lo) * (x - xs[j - 1]) / (xs[j] - xs[j - 1])

    def _phase_time(self, es: ExecutionState, phase: str, corun: bool) -> float:
        counts = phase_counts(es, phase)
        t = self._roofline(es, phase, counts, corun)
        if t == 0.0:
            return 0.0
        alpha = self._alpha_at(es, phase, counts[TOKENS], corun)
        comm = self.communication_s(es, phase, counts) if self._all_reduce else 0.0
        return self.hw.step_overhead_s + alpha * t + comm + self.sampling_s(es, phase)

    def communication_s(self, es: ExecutionState, phase: str, counts: Counts) -> float:
        """The tensor-parallel collectives of `phase` of `es`: two all-reduces of the hidden
        states per layer, and the logits' gather after the last."""
        layers, _, last = phase_layers(self.cfg, es, phase)
        d = DTYPE_BYTES[self.dtype]
        total = 2 * layers * self._all_reduce(counts[TOKENS] * self.cfg.hidden_size * d)
        if last:
            logits = counts[SEQS] * self.cfg.vocab_size * LOGIT_BYTES / self.tensor_parallel_size
            total += self._all_reduce(logits)
        return total

    def sampling_s(self, es: ExecutionState, phase: str) -> float:
        """The sampler's time for `phase` of `es`: a row per sequence whose step reaches the
        LM head, on the phase's units (a fused chunked step counts its prompt chunks as rows,
        the one that does not end its prompt included)."""
        if self._sampling_per_row is None:
            return 0.0
        if phase == "decode":
            rows, units = es.decode_rows, es.decode_units
        else:
            last = phase_layers(self.cfg, es, phase)[2]
            rows, units = (len(es.prefill_lens) if last else 0), es.prefill_units
        return rows * self._sampling_per_row(units) if rows else 0.0

    def host_s(self, rows: int) -> float:
        """The engine's own time around a step that samples `rows` sequences, outside the model
        and the sampler (the profile's measured host cost; 0 where it has none). Not part of
        `predict`: the engine's step log and the online correction time the model alone."""
        cal = self.hw.calibration
        return cal.host_s_per_step + cal.host_s_per_row * rows

    def uncorrected(self, es: ExecutionState) -> StepPrediction:
        """Prefill and decode step times of `es` before any online correction."""
        corun = es.has_prefill and es.has_decode
        return StepPrediction(
            self._phase_time(es, "prefill", corun), self._phase_time(es, "decode", corun)
        )

    def predict(self, es: ExecutionState, corrections: Corrections | None = None) -> StepPrediction:
        """Prefill and decode step times of `es` in seconds (0 for an idle lane), under
        `corrections` (None: the model's own, as `observe` last left them)."""
        corun = es.has_prefill and es.has_decode
        c = self.corrections if corrections is None else corrections
        raw = self.uncorrected(es)
        times = []
        for phase, seconds in (("prefill", raw.prefill_s), ("decode", raw.decode_s)):
            if seconds:
                bucket = size_bucket(es, phase) if c.buckets else None
                seconds *= c.factor(phase, corun, bucket)
            times.append(seconds)
        return StepPrediction(*times)

    def observe(self, es: ExecutionState, phase: str, measured_s: float) -> None:
        """Fold one measured step time of `phase` into its running corrections: a step alone
        moves the phase's own and its size bucket's, a step beside the other lane's the
        co-running factor on top of them."""
        if phase not in PREDICT_PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected 'prefill' or 'decode'")
        corun = es.has_prefill and es.has_decode
        raw = self.uncorrected(es)
        predicted = raw.prefill_s if phase == "prefill" else raw.decode_s
        if predicted <= 0.0 or measured_s <= 0.0:
            return
        ratio = measured_s / predicted
        if not _RATIO_BAND[0] <= ratio <= _RATIO_BAND[1]:
            return
        c = self.corrections
        bucket = (phase, size_bucket(es, phase))
        if corun:
            key = f"corun_{phase}"
            alone = c.factor(phase, corun=False, bucket=bucket[1])
            updated = self._blend(key, getattr(c, key), ratio / alone)
            self.corrections = replace(c, **{key: updated})
            return
        buckets = dict(c.buckets)
        buckets[bucket] = self._blend(bucket, buckets.get(bucket, getattr(c, phase)), ratio)
        self.corrections = replace(
            c,
            **{phase: self._blend(phase, getattr(c, phase), ratio)},
            buckets=tuple(sorted(buckets.items())),
        )

    def reset_corrections(self) -> None:
        """Forget every observation: the model as a new engine starts it."""
        self.corrections = Corrections()
        self._observed.clear()

    def _blend(self, key: object, current: float, ratio: float) -> float:
        """The correction `key` after one more observed ratio: the mean of the first ones, then
        an EWMA of weight `correction_weight`."""
        seen = self._observed[key] = self._observed.get(key, 0) + 1
        weight = max(self.correction_weight, 1.0 / seen)
        return (1 - weight) * current + weight * ratio


def _all_reduce_curve(hw: HardwareProfile, ranks: int) -> AllReduceTime | None:
    if ranks == 1:
        return None
    points = hw.calibration.all_reduce_s.get(ranks)
    if not points:
        known = ", ".join(map(str, hw.calibration.all_reduce_s)) or "none"
        raise ValueError(
            f"hardware profile {hw.name!r} has no all-reduce times for {ranks} ranks "
            f"(it has: {known}); the a100-80gb and h100-sxm presets carry 2, 4 and 8"
        )
    return AllReduceTime(points)


class AllReduceTime:
    """An all-reduce's seconds for a message of n bytes: linear between measured sizes, the
    smallest's latency below them, and bandwidth-bound (proportional) above the largest."""

    def __init__(self, points: tuple[tuple[float, float], ...]) -> None:
        self._curve = Curve.from_points(points, log_x=False)
        self._largest = points[-1]

    def __call__(self, nbytes: float) -> float:
        size, seconds = self._largest
        if nbytes > size:
            return seconds * nbytes / size
        return self._curve(nbytes)
