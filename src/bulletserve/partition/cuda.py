"""GPU partitioning: a lane's units are SMs of a green context (CUDA >= 12.4 driver)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from bulletserve.partition.errors import UnitsUnavailableError
from bulletserve.partition.limits import gpu_min_remainder

T = TypeVar("T")


def carve_for(units: int, total: int, granularity: int) -> int:
    """The SM count to carve so that a lane gets exactly `units` SMs: `units` itself when it is
    a multiple of the granularity, else the group beside which `units` SMs remain."""
    carved = units if units % granularity == 0 else total - units
    if carved % granularity or not 0 < carved < total:
        raise UnitsUnavailableError(
            f"cannot carve a green context of {units} SMs: neither it nor the "
            f"{total - units} beside it is a multiple of {granularity}"
        )
    return carved


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Run the body on `stream`, after the work queued on the caller's stream and before the
    work the caller queues next: a lane's inputs are copied, and its logits sampled, on the
    caller's stream, and lane streams are non-blocking (nothing orders them implicitly; on an
    H200 a replayed decode graph's logits were sampled before the graph wrote them)."""
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


class _ThreadStreams:
    """One CUDA stream per OS thread, for a lane that runs on every SM: two lanes on the
    default stream would run one after the other, never side by side."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._local = threading.local()

    def current(self) -> torch.cuda.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self._device)
        return stream


class _GpuUnits:
    """What both GPU partitioners share (each defines `lane`): a lane's step runs on the
    calling thread, inside `lane(units, rest)`, and is timed on that lane's stream alone."""

    device: torch.device

    def synchronize(self) -> None:
        """Wait for the calling lane's stream only, so two lanes are timed independently."""
        torch.cuda.current_stream(self.device).synchronize()

    def run(self, units: int, step: Callable[[], T], rest: bool = False) -> T:
        """`step()` on the calling thread, inside `lane(units, rest)`."""
        with self.lane(units, rest):
            return step()


class GreenContextSMs(_GpuUnits):
    """Units are SMs of one CUDA device, split into disjoint green contexts through the driver
    API (`cuDevSmResourceSplitByCount`): one group of the lane's SMs and the remainder, each
    with its own stream. Needs CUDA and the `cuda-bindings` package (CUDA >= 12.4 driver)."""

    kind = "gpu"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise UnitsUnavailableError("--device cuda: CUDA is not available")
        try:
            from cuda.bindings import driver
        except ImportError:
            raise UnitsUnavailableError(
                "--device cuda needs green contexts through the `cuda-bindings` package "
                "(pip install cuda-bindings)"
            ) from None
        self._driver = driver
        self.device = device
        torch.cuda.init()
        props = torch.cuda.get_device_properties(device)
        self.total = props.multi_processor_count
        self.granularity = self.min_units = 8 if props.major >= 9 else 2
        if props.major < 9:
            self.min_units = 4
        # The scheduler's UnitSpace keeps to it (see limits.py for why).
        self.min_remainder = gpu_min_remainder(self.total)
        self._cu_dev = self._check(driver.cuDeviceGet(device.index or 0))
        self._resource = self._check(
            driver.cuDeviceGetDevResource(
                self._cu_dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
            )
        )
        # carved SM count -> (stream on the carved group, stream on the SMs beside it)
        self._streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._keep: list[object] = []  # green contexts must outlive their streams
        self._whole = _ThreadStreams(device)

    def _check(self, result: tuple) -> object:
        err = result[0]
        if int(err) != 0:
            _, name = self._driver.cuGetErrorName(err)
            raise UnitsUnavailableError(f"CUDA driver call failed: {name}")
        return result[1] if len(result) == 2 else result[1:]

    def _stream_for(self, resource: object) -> torch.cuda.Stream:
        d = self._driver
        desc = self._check(d.cuDevResourceGenerateDesc([resource], 1))
        ctx = self._check(
            d.cuGreenCtxCreate(
                desc, self._cu_dev, d.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
            )
        )
        stream = self._check(
            d.cuGreenCtxStreamCreate(ctx, d.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        )
        self._keep += [ctx, stream]
        return torch.cuda.ExternalStream(int(stream), device=self.device)

    def _split(self, units: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(stream on a group of exactly `units` SMs, stream on the other SMs). The driver
        carves groups in multiples of the granularity; a count that is not one is the
        remainder beside a group of `total - units` (the decode lane beside a prefill group),
        and shares that carve's green contexts."""
        carved = carve_for(units, self.total, self.granularity)
        if carved not in self._streams:
            groups, count, rest = self._check(
                self._driver.cuDevSmResourceSplitByCount(1, self._resource, 0, carved)
            )
            if count < 1 or groups[0].sm.smCount != carved:
                raise UnitsUnavailableError(f"cannot carve a green context of {carved} SMs")
            self._streams[carved] = (self._stream_for(groups[0]), self._stream_for(rest))
        group, remainder = self._streams[carved]
        return (group, remainder) if carved == units else (remainder, group)

    def prepare(self, counts: list[int]) -> None:
        """Create the green contexts and streams of every split a lane may be given, before
        serving: creating one while the other lane's kernels run costs that step time."""
        for units in counts:
            if 0 < units < self.total:
                self._split(units)

    @contextlib.contextmanager
    def lane(self, units: int, rest: bool = False) -> Iterator[None]:
        """Run the body on a green context of `units` SMs (`rest`: on the SMs left over)."""
        if units >= self.total and not rest:
            with _on_stream(self._whole.current()):
                yield
            return
        group, remainder = self._split(units)
        with _on_stream(remainder if rest else group):
            yield


class WholeGPU(_GpuUnits):
    """No partitioning: both lanes share every SM (the fallback where green contexts are
    unavailable, and the paper's naive ablation)."""

    kind = "gpu"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total = torch.cuda.get_device_properties(device).multi_processor_count
        self.granularity = self.min_units = self.total
        self.min_remainder = None  # there is never a remainder
        self._whole = _ThreadStreams(device)

    def prepare(self, counts: list[int]) -> None:
        """Nothing to create: every lane runs on every SM."""

    @contextlib.contextmanager
    def lane(self, units: int, rest: bool = False) -> Iterator[None]:
        """Run the body on every SM, on the calling thread's own stream."""
        with _on_stream(self._whole.current()):
            yield
