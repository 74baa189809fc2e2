"""The scheduler's settings, each default stated once: what the engine's config and the
simulator's share (both extend `SchedulerConfig`), and the one function that builds a policy
from them (the engine's own settings: engine/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from bulletserve.sched.base import SCHEDULING_POLICIES, Policy, SchedulingPolicy
from bulletserve.sched.bullet import BulletPolicy, UnitSpace, parse_partition
from bulletserve.sched.chunked import ChunkedPolicy
from bulletserve.sched.drafts import DraftRule
from bulletserve.sched.prefill_first import PrefillFirstPolicy
from bulletserve.sched.slo import SLO

if TYPE_CHECKING:
    from bulletserve.perf.model import PerfModel

PolicyName = Literal["chunked", "prefill-first", "bullet"]
POLICIES: tuple[PolicyName, ...] = ("chunked", "prefill-first", "bullet")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How requests are scheduled: the policy, the batch limits, the KV blocks, and Bullet's
    own settings (`partition`, `prefill_layers_per_step`, `fuse_decode`)."""

    policy: PolicyName = "chunked"
    scheduling_policy: SchedulingPolicy = "fcfs"  # vLLM's: fcfs, or by each request's priority
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    chunked_prefill_size: int | None = None  # default: max_num_batched_tokens
    block_size: int = 16
    enable_prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (full blocks)
    partition: str = "auto"  # auto | none | static:P/D
    prefill_layers_per_step: int | None = None  # None: all layers in one step
    fuse_decode: bool = True  # a prefill step may carry the decode rows (the fused rules)
    # Shed (refuse with a 429) a request still waiting for its first step after this long: past
    # capacity, the requests that would miss their SLO anyway go, not every request's SLO.
    max_queue_delay_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _at_least_one(name, getattr(self, name))
        for name in ("chunked_prefill_size", "prefill_layers_per_step"):
            if getattr(self, name) is not None:
                _at_least_one(name, getattr(self, name))
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--scheduling-policy must be fcfs or priority, not {self.scheduling_policy!r}"
            )
        parse_partition(self.partition)
        if self.max_queue_delay_ms is not None and not self.max_queue_delay_ms > 0:
            raise ValueError(f"--max-queue-delay-ms must be > 0, got {self.max_queue_delay_ms}")

    @property
    def chunk_size(self) -> int:
        return self.chunked_prefill_size or self.max_num_batched_tokens


def _at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def make_policy(
    config: SchedulerConfig,
    slo: SLO | None = None,
    perf: PerfModel | None = None,
    units: UnitSpace | None = None,
    num_layers: int | None = None,
    drafts: DraftRule | None = None,
    price_drafts: bool = True,
) -> Policy | BulletPolicy:
    """The policy `config` names. Bullet's also needs the SLO, the performance model, the
    device's units and the model's layer count. `drafts`: the one-lane policies' draft rule
    under speculative decoding (None: every draft the budget leaves room for); Bullet builds
    its own from its performance model for the units its decode lane gets, unless
    `price_drafts` is False (every draft)."""
    if config.policy == "chunked":
        return ChunkedPolicy(config.chunk_size, drafts)
    if config.policy == "prefill-first":
        return PrefillFirstPolicy(drafts)
    if slo is None:
        raise ValueError(
            "the bullet policy needs SLOs: pass --slo-ttft-per-token-ms and --slo-tpot-ms"
        )
    if perf is None or units is None or num_layers is None:
        raise ValueError("the bullet policy needs the performance model, units and layers")
    mode, static = parse_partition(config.partition, units.total)
    return BulletPolicy(
        perf=perf,
        units=units,
        num_layers=num_layers,
        slo=slo,
        layers_per_step=config.prefill_layers_per_step,
        partition=mode,
        static_split=static,
        fuse_decode=config.fuse_decode,
        price_drafts=price_drafts,
    )
