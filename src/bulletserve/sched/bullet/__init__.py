"""Bullet's SLO-aware scheduler: the policy (policy.py), its split as a table of rules
(rules.py), what the performance model says of the ways to run (estimates.py), its tunables and
device traits (params.py), and the data it sees and decides (types.py). Pure: no torch, no
threads, no I/O."""

from bulletserve.sched.bullet.params import BulletParams, DeviceTraits
from bulletserve.sched.bullet.policy import BulletPolicy
from bulletserve.sched.bullet.rules import RULE_NAMES, RULES, Rule, Situation
from bulletserve.sched.bullet.types import (
    BulletPlan,
    BulletSnapshot,
    Fusion,
    LatencyStats,
    LatencyWindow,
    PartitionMode,
    PrefillInFlight,
    PrefillStep,
    Split,
    UnitSpace,
    parse_partition,
)

__all__ = [
    "RULES",
    "RULE_NAMES",
    "BulletParams",
    "BulletPlan",
    "BulletPolicy",
    "BulletSnapshot",
    "DeviceTraits",
    "Fusion",
    "LatencyStats",
    "LatencyWindow",
    "PartitionMode",
    "PrefillInFlight",
    "PrefillStep",
    "Rule",
    "Situation",
    "Split",
    "UnitSpace",
    "parse_partition",
]
