"""Tensor parallelism on torch.distributed: who this process is, the collectives the model
calls, and the channels over which rank 0 tells the other ranks what to run.

Every rank holds a shard of the weights (`model.shard`) and of the KV pool (its KV heads) and
runs every step rank 0's policy plans: rank 0 announces the step's work (pure data: token ids,
positions, block tables, where it runs) on the lane's channel, then every rank runs the same
forward, meeting at one all-reduce after attention and one after the MLP, and rank 0 gathers
the vocabulary-parallel logits and samples. Under bullet the two lanes run side by side on
every rank, so each lane has process groups of its own (its channel): the collectives of
one lane never interleave with the other's. The single-lane executors use the decode channel.
Commands travel over gloo groups on the host (as vLLM's do), the model's collectives over the
device's backend (NCCL on GPUs, gloo on CPUs).

With one rank nothing here touches torch.distributed: the same code runs, and every
collective returns its input.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

Channel = Literal["prefill", "decode"]
CHANNELS: tuple[Channel, ...] = ("prefill", "decode")


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot run a step."""


@dataclass(frozen=True)
class Shard:
    """This rank's place among `size` ranks."""

    rank: int = 0
    size: int = 1

    def range(self, total: int) -> tuple[int, int]:
        """The [start, end) of this rank's equal share of `total` (which `size` divides)."""
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def padded_range(self, total: int) -> tuple[int, int]:
        """This rank's share of `total` cut into `size` parts of ceil(total / size), the last
        shorter (the vocabulary, which need not divide)."""
        share = -(-total // self.size)
        return min(total, self.rank * share), min(total, (self.rank + 1) * share)


class TensorParallel:
    """This process's rank and its groups. `TensorParallel()` is the one-rank case."""

    def __init__(
        self,
        shard: Shard = Shard(),
        groups: dict[Channel, dist.ProcessGroup] | None = None,
        host_groups: dict[Channel, dist.ProcessGroup] | None = None,
    ) -> None:
        self.shard = shard
        self._groups = groups or {}  # the model's collectives
        self._host_groups = host_groups or self._groups  # commands (gloo)
        self._local = threading.local()
        # Which ranks have died, for error messages (set by whoever started them).
        self.failure_detail: Callable[[], str] = lambda: ""

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def leads(self) -> bool:
        """Whether this rank plans the steps and announces them (rank 0 of several)."""
        return self.shard.size > 1 and self.shard.rank == 0

    @classmethod
    def join(
        cls, rank: int, size: int, init_method: str, backend: str, timeout_s: float
    ) -> TensorParallel:
        """Join the group of `size` ranks at `init_method` (every rank calls this), with a
        process group per channel."""
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )
        # Every rank creates the groups in the same order, as torch.distributed requires.
        groups = {channel: dist.new_group(backend=backend) for channel in CHANNELS}
        host_groups = groups
        if backend != "gloo":
            host_groups = {channel: dist.new_group(backend="gloo") for channel in CHANNELS}
        return cls(Shard(rank, size), groups, host_groups)

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def on(self, channel: Channel) -> contextlib.AbstractContextManager[None]:
        """The model's collectives in the body (on the calling thread) go over `channel` (with
        one rank there are none: nothing to set on every step)."""
        if self.size == 1:
            return contextlib.nullcontext()
        return self._on(channel)

    @contextlib.contextmanager
    def _on(self, channel: Channel) -> Iterator[None]:
        previous = getattr(self._local, "channel", None)
        self._local.channel = channel
        try:
            yield
        finally:
            self._local.channel = previous

    def _group(self) -> dist.ProcessGroup:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            raise RuntimeError("a tensor-parallel collective outside a channel (TensorParallel.on)")
        return self._groups[channel]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        if self.size == 1:
            return x
        try:
            dist.all_reduce(x, group=self._group())
        except RuntimeError as exc:
            raise self._failed("all-reduce", exc) from exc
        return x

    def gather_columns(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """Rank 0: every rank's columns side by side, `total` wide (shares from
        `Shard.padded_range`); other ranks get their own back."""
        if self.size == 1:
            return local
        share = -(-total // self.size)
        if local.shape[1] < share:
            local = torch.nn.functional.pad(local, (0, share - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.shard.rank == 0 else None
        try:
            dist.gather(local, parts, dst=0, group=self._group())
        except RuntimeError as exc:
            raise self._failed("logits gather", exc) from exc
        if parts is None:
            return local
        return torch.cat(parts, dim=1)[:, :total]

    def announce(self, channel: Channel, command: object) -> None:
        """Rank 0: send `command` to every rank's `channel` (nothing with one rank)."""
        if not self.leads:
            return
        try:
            dist.broadcast_object_list([command], src=0, group=self._host_groups[channel])
        except RuntimeError as exc:
            raise self._failed("step announcement", exc) from exc

    def receive(self, channel: Channel) -> object:
        """A rank other than 0: the next command rank 0 announced on `channel`."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self._host_groups[channel])
        return box[0]

    def _failed(self, what: str, exc: Exception) -> RankFailedError:
        detail = self.failure_detail()
        return RankFailedError(
            f"tensor-parallel {what} failed ({detail or 'a rank did not answer'}): {exc}"
        )

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks each rank's memory holds)."""
        return self._agree(value, dist.ReduceOp.MIN)

    def agree_max(self, value: int) -> int:
        """The largest of every rank's `value`."""
        return self._agree(value, dist.ReduceOp.MAX)

    def _agree(self, value: int, op: dist.ReduceOp) -> int:
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=op, group=self._host_groups["decode"])
        return int(tensor.item())
