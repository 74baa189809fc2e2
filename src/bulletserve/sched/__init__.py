"""Scheduling policies: pure functions of a snapshot, returning a plan."""

from __future__ import annotations

from bulletserve.sched.config import POLICIES, PolicyName, SchedulerConfig, make_policy
from bulletserve.sched.slo import SLO, ServiceClass

__all__ = ["POLICIES", "SLO", "PolicyName", "SchedulerConfig", "ServiceClass", "make_policy"]
