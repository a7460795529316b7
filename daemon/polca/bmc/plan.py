"""When to cap a node through its BMC, and when to let go (pure; time passed in).

polca caps GPUs in-band, through each node's agent. A node whose agent is dead, hung or
partitioned keeps whatever limits it had while its row runs hot, and one in fail-safe
holds only the policy's fail-safe caps. ``OobPlanner`` decides, at each control step of
the aggregator, which nodes must be capped out of band (through the BMC) and which may be
released, from what the aggregator knows of each node (``NodeState``):

- **cap** a node with a BMC only when its agent cannot: its telemetry is stale, it is
  offline (Last Will, clean stop) or never heard from, or it reports ``fail_safe``; *and*
  its scope (the row, or its rack when that is higher) is at or over ``cap_from_level``.
  The limit written is the node's ``fail_safe_w``, or its ``brake_w`` while the scope is
  at the policy's top level (the brake), so the brake reaches nodes whose agent does not
  answer;
- **release** a capped node only when its agent is back in control (fresh telemetry, not
  in fail-safe, for ``agent_back_s``) *and* its scope is back at level 0 (under the release
  band: the controller's hysteresis already held it there); an agent back while the row is
  still hot leaves the out-of-band cap on (the GPU obeys the lower of the two limits);
- anything else: hold what is in force. A node's target changes only on these rules, so a
  flapping input does not turn into BMC writes (the actuator also rate-limits them).

What this module must not do: talk to a BMC (``bmc/actuator.py`` does), read a clock, or
know the aggregator's types (it is handed ``NodeState``s).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = ["NodeState", "OobPlanner", "OobTarget", "agent_cannot"]

Health = Literal["fresh", "stale", "offline", "unknown"]


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node with a BMC, as the aggregator saw it at a control step."""

    node: str
    health: Health
    fail_safe: bool
    """Its last telemetry said it applies the fail-safe caps (no valid lease)."""
    level: int
    """The level of its scope: the higher of its row's and its rack's."""
    top_level: int
    """The policy's top level (the brake)."""
    fail_safe_w: float
    brake_w: float


@dataclass(frozen=True, slots=True)
class OobTarget:
    """What a node's BMC limit should be: ``watts`` (capped) or None (released)."""

    node: str
    watts: float | None
    reason: str

    def log_line(self) -> tuple[str, str, dict[str, object]]:
        """How the aggregator logs wanting it: (level, event, fields); always a warning,
        since either way a node's agent could not be relied on."""
        event = "oob_cap_wanted" if self.watts is not None else "oob_release_wanted"
        return "warning", event, {"node": self.node, "watts": self.watts, "reason": self.reason}


def agent_cannot(state: NodeState) -> bool:
    """Whether the node's agent cannot be relied on to cap it."""
    return state.health != "fresh" or state.fail_safe


@dataclass(slots=True)
class _Held:
    watts: float
    back_since_s: float | None = None


class OobPlanner:
    """Which nodes are capped out of band; ``plan`` returns only what changed."""

    def __init__(self, *, cap_from_level: int = 1, agent_back_s: float = 5.0) -> None:
        """Cap at or over ``cap_from_level``; release after ``agent_back_s`` of control."""
        self.cap_from_level = cap_from_level
        self.agent_back_s = agent_back_s
        self._held: dict[str, _Held] = {}  # keyed by configured node names only

    @property
    def capped(self) -> dict[str, float]:
        """The nodes capped out of band now, and their limits."""
        return {node: held.watts for node, held in self._held.items()}

    def plan(self, states: Iterable[NodeState], now_s: float) -> list[OobTarget]:
        """The targets that changed at this step, in the order of ``states``."""
        changes: list[OobTarget] = []
        for state in states:
            change = self._one(state, now_s)
            if change is not None:
                changes.append(change)
        return changes

    def forget(self, node: str) -> None:
        """Stop tracking ``node`` (its cap could not be lifted: held as the actuator's)."""
        self._held.pop(node, None)

    def _one(self, state: NodeState, now_s: float) -> OobTarget | None:
        held = self._held.get(state.node)
        cannot = agent_cannot(state)
        if cannot and state.level >= self.cap_from_level:
            brake = state.level >= state.top_level
            watts = state.brake_w if brake else state.fail_safe_w
            why: str = "offline" if state.health in ("offline", "unknown") else state.health
            if state.health == "fresh":
                why = "in fail-safe"
            reason = f"agent {why} at level {state.level}" + (" (brake)" if brake else "")
            if held is None or held.watts != watts:
                self._held[state.node] = _Held(watts)
                return OobTarget(state.node, watts, reason)
            held.back_since_s = None
            return None
        if held is None:
            return None
        if cannot:
            held.back_since_s = None
            return None
        if held.back_since_s is None:
            held.back_since_s = now_s
        if state.level == 0 and now_s - held.back_since_s >= self.agent_back_s:
            del self._held[state.node]
            return OobTarget(state.node, None, "agent back in control and scope released")
        return None
