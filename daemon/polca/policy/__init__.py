"""Policies: the YAML model, its loader, and the pure engine and ladder that apply it.

Nothing here touches NVML or MQTT (an import-linter contract checks it), so the node
agent, the aggregator and the simulator share the same decisions.
"""

from polca.policy.engine import (
    ControlInput,
    Decision,
    EngineState,
    GpuTarget,
    GpuView,
    decide,
    tighter,
    within,
)
from polca.policy.ladder import LadderState, next_level
from polca.policy.loader import (
    LoadedPolicy,
    PolicyStore,
    ReloadResult,
    check_files,
    load_policy,
    parse_policy,
)
from polca.policy.model import CapSpec, Level, Policy, ThermalGuard
from polca.policy.schema import policy_json_schema
from polca.policy.trend import trend_w_per_s

__all__ = [
    "CapSpec",
    "ControlInput",
    "Decision",
    "EngineState",
    "GpuTarget",
    "GpuView",
    "LadderState",
    "Level",
    "LoadedPolicy",
    "Policy",
    "PolicyStore",
    "ReloadResult",
    "ThermalGuard",
    "check_files",
    "decide",
    "load_policy",
    "next_level",
    "parse_policy",
    "policy_json_schema",
    "tighter",
    "trend_w_per_s",
    "within",
]
