"""Latency-budget control (pure Python): cost model, per-tick planner, in-tick deadline guard."""

from .cost_model import CallCosts, CostModel
from .guard import DeadlineGuard
from .history import SessionHistory
from .planner import DEFAULT_LADDER, MAX_CACHING, CacheSetting, PlannerConfig, TickPlan, plan_tick
from .tick import GuardedSteps, TickBudget

__all__ = [
    "DEFAULT_LADDER",
    "MAX_CACHING",
    "CacheSetting",
    "CallCosts",
    "CostModel",
    "DeadlineGuard",
    "GuardedSteps",
    "PlannerConfig",
    "SessionHistory",
    "TickBudget",
    "TickPlan",
    "plan_tick",
]
