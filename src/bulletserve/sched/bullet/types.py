"""What Bullet's policy sees and decides: the device's units, the SLOs, the snapshot a lane plans
from, and the plan it gets. Pure data."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from bulletserve.perf.model import Corrections
from bulletserve.sched.base import ScheduledSeq, SeqView
from bulletserve.sched.slo import SLO

PartitionMode = Literal["auto", "none", "static"]


@dataclass(frozen=True)
class Split:
    """Units per lane, and the name of the rule that chose them (`rules.RULES`). 0 pauses a
    lane; with partitioning off both lanes get every unit."""

    prefill: int
    decode: int
    rule: str


@dataclass(frozen=True)
class UnitSpace:
    """The device's compute units: how many, and which counts a lane may get."""

    total: int
    granularity: int
    minimum: int
    # The fewest units a lane may run on when they are what is left beside a carved group
    # (None: `minimum`); the GPU partitioner sets it (see partition/cuda.py for why).
    min_remainder: int | None = None

    def counts(self) -> list[int]:
        """Unit counts a lane may be given as a carved group, ascending."""
        start = math.ceil(self.minimum / self.granularity) * self.granularity
        valid = set(range(start, self.total + 1, self.granularity)) | {self.total}
        return sorted(c for c in valid if c >= self.minimum)

    @property
    def least_remainder(self) -> int:
        """Fewest units a lane may run on beside a carved group."""
        return max(self.minimum, self.min_remainder or 0)

    def is_valid(self, units: int) -> bool:
        """0 (paused), a carved group, or what is left beside one (e.g. 124 of 132 SMs)."""
        if units == 0:
            return True
        carved = self.counts()
        return units in carved or (units >= self.least_remainder and self.total - units in carved)

    def round_down(self, units: int) -> int:
        """The largest carved group of at most `units` (0 if none)."""
        valid = [c for c in self.counts() if c <= units]
        return valid[-1] if valid else 0


@dataclass(frozen=True)
class LatencyStats:
    """P90s over a sliding window of recent requests, each latency over the request's own
    target (above 1: missed); None until there is data."""

    p90_ttft_over_slo: float | None = None
    p90_tpot_over_slo: float | None = None
    # The performance model's recent error: median |predicted / measured - 1| of the last
    # MODEL_ERROR_STEPS steps (None until there are that many).
    model_error: float | None = None


# Steps behind `LatencyStats.model_error`: enough that one stalled step does not count.
MODEL_ERROR_STEPS = 16


class LatencyWindow:
    """P90 TTFT over the last `size` first tokens and P90 TPOT over the last `size` finished
    requests, each over the request's own SLO (`slo`, the server's, where it has none of its
    own), per SLO: the stats are the worst of the SLOs' P90s, so that a class with tight
    targets that misses is not hidden among many looser requests that hold. The engine and the
    simulator feed it the same way. TTFT is counted when the first token comes, not when the
    request ends: with outputs of hundreds of tokens the window would otherwise report the TTFT
    of requests that arrived many seconds ago, and a prefill starved since would go unseen."""

    def __init__(self, slo: SLO, size: int) -> None:
        self.slo = slo
        self.size = size
        self.ttft_over_slo: dict[SLO, deque[float]] = {}
        self.tpot_over_slo: dict[SLO, deque[float]] = {}
        self.step_errors: deque[float] = deque(maxlen=MODEL_ERROR_STEPS)

    def first_token(self, ttft_s: float, prompt_tokens: int, slo: SLO | None = None) -> None:
        slo = slo or self.slo
        self._window(self.ttft_over_slo, slo).append(ttft_s / slo.ttft_s(prompt_tokens))

    def finished(self, tpot_s: float | None, slo: SLO | None = None) -> None:
        """A request ended; tpot_s is None when it produced a single token."""
        if tpot_s is not None:
            slo = slo or self.slo
            self._window(self.tpot_over_slo, slo).append(tpot_s / slo.tpot_s)

    def _window(self, windows: dict[SLO, deque[float]], slo: SLO) -> deque[float]:
        if slo not in windows:
            windows[slo] = deque(maxlen=self.size)
        return windows[slo]

    def step(self, predicted_s: float, measured_s: float) -> None:
        """A lane's step ended: how far the performance model's prediction (under the
        corrections it was planned with) was from its measured time."""
        if predicted_s > 0 and measured_s > 0:
            self.step_errors.append(abs(predicted_s / measured_s - 1))

    def stats(self) -> LatencyStats:
        errors = self.step_errors
        model_error = None
        if len(errors) == errors.maxlen:
            model_error = sorted(errors)[len(errors) // 2]
        return LatencyStats(
            _worst_p90(self.ttft_over_slo), _worst_p90(self.tpot_over_slo), model_error
        )


def _worst_p90(windows: dict[SLO, deque[float]]) -> float | None:
    p90s = [p for p in map(_p90, windows.values()) if p is not None]
    return max(p90s) if p90s else None


def _p90(values: deque[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def parse_partition(
    text: str, total_units: int | None = None
) -> tuple[PartitionMode, Split | None]:
    """`--partition auto|none|static:P/D` -> (mode, static split). A static split must cover
    the device (P + D equal to its units), checked when its unit count is known: decode runs on
    what prefill leaves, so a D below that would be a split the device does not run."""
    if text == "auto" or text == "none":
        return text, None
    try:
        if not text.startswith("static:"):
            raise ValueError
        prefill, decode = (int(x) for x in text.removeprefix("static:").split("/"))
    except ValueError:
        raise ValueError(f"--partition must be auto, none or static:P/D, not {text!r}") from None
    if total_units is not None and prefill + decode != total_units:
        raise ValueError(
            f"--partition {text}: P + D must equal the device's {total_units} units "
            "(decode runs on what prefill leaves)"
        )
    return "static", Split(prefill, decode, "static")


@dataclass(frozen=True)
class PrefillInFlight:
    """The prefill lane's current batch, how many layers of its current pass it has run, and
    whether a step of it is running now. A batch whose prompt has computed some chunks and has
    more to go is in flight with `layers_done` 0 between its steps."""

    requests: tuple[SeqView, ...]
    layers_done: int
    stepping: bool = False


@dataclass(frozen=True)
class BulletSnapshot:
    """Everything a lane's plan depends on: the queues, the KV pool, recent latencies, the
    split in force, and the performance model's online corrections at this moment."""

    now: float
    waiting: tuple[SeqView, ...]
    prefill: PrefillInFlight | None
    decoding: tuple[SeqView, ...]
    free_blocks: int
    block_size: int
    max_num_seqs: int
    max_prefill_tokens: int
    stats: LatencyStats
    split: Split  # the split in force
    corrections: Corrections = Corrections()
    max_loras: int | None = None  # the most LoRA adapters running together (None: any)


@dataclass(frozen=True)
class PrefillStep:
    """Run layers [layer_start, layer_end) of the batch; `admitted` is non-empty when the step
    starts a new batch from the waiting queue. `decode` holds the decoding requests whose next
    token the step computes too, fused into its batch (rules `fused`, `fused-ttft-first`); the
    decode lane pauses meanwhile. `chunk` is set when the step computes only the next `chunk`
    tokens of the batch's one prompt (a fused step that would not fit the TPOT budget whole);
    the prompt stays in the prefill lane until its last chunk."""

    admitted: tuple[str, ...]
    layer_start: int
    layer_end: int
    decode: tuple[ScheduledSeq, ...] = ()
    chunk: int | None = None


@dataclass(frozen=True)
class Fusion:
    """A fused step the policy could run: its prompts (the batch, its first few, or its first
    alone), the chunk of that prompt (None: every prompt's rest), its work per second against a
    prefill step and a decode step one after the other (`gain`), its predicted time, and
    whether it outlasts the TPOT budget because TTFT misses while TPOT holds (`ttft_first`)."""

    prompts: tuple[SeqView, ...]
    chunk: int | None
    gain: float
    seconds: float
    ttft_first: bool = False


@dataclass(frozen=True)
class BulletPlan:
    split: Split
    prefill: PrefillStep | None = None
    decode: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[str, ...] = ()
