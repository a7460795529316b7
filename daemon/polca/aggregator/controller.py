"""The POLCA row controller: row (or rack) power -> level -> a leased control message.

One ``ScopeController`` per row, and one per rack that has its own budget. Each interval it
runs the shared ladder (``polca.policy.next_level``: escalate at once, brake on trend,
release one level at a time after a dwell below threshold minus margin) on the scope's
power against its effective budget, and produces the retained control message that renews
the agents' lease. A level change also produces an audit record with the inputs that led
to it. Pure: no I/O; time comes in as arguments.

Restart without a spurious uncap: ``seed()`` takes the retained control message a previous
aggregator left on the broker, so the ladder starts at the level in force and can only
release after a full dwell, as if nothing had happened.

Retained state is validated before it is trusted, and policies change under a running
ladder: every level that comes from outside the current policy (a seed, the level in force
when a reload removed levels, a forced floor) is clamped (``Policy.clamp_level``) before it
is used, and nothing indexes ``policy.levels`` with an unclamped number. A budget that is
not a positive finite number (a thermal budget derated to nothing) counts as exceeded
(``usable_budget_w``, the ladder's), and the ladder says why each level is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from polca.policy import LadderState, next_level
from polca.policy.ladder import usable_budget_w
from polca.policy.model import Policy
from polca.telemetry.schema import Control


@dataclass(frozen=True, slots=True)
class ScopeDecision:
    """One evaluation of one scope."""

    control: Control
    level: int
    level_name: str
    previous_level: int
    changed: bool
    power_pct: float
    thresholds_w: tuple[float, ...]
    audit: dict[str, Any]
    brakes: int = 0
    """The scope's brake entries since start (``ScopeController.brakes``)."""


_REASON_CHARS = 512
"""The wire limit of ``Control.reason``."""
_MAX_SEEDED_SEQ = 2**62
"""Room left for this run's messages above a retained sequence number."""


def level_name(policy: Policy, level: int) -> str:
    """``nominal`` for 0 (or less), else the policy's name of that level (clamped)."""
    return policy.level_name(level)


@dataclass(slots=True)
class ScopeController:
    """The ladder and message sequence of one row or rack."""

    site: str
    row: str
    rack: str | None
    issuer: str
    epoch_ns: int
    term: int = 0
    """The leadership term stamped on every control message (0: no election)."""
    ladder: LadderState = field(default_factory=LadderState)
    seq: int = 0
    seeded_from: int | None = None
    published_level: int = 0
    brakes: int = 0
    """How often this scope entered the policy's top level (the brake) since start."""

    @property
    def scope(self) -> Literal["row", "rack"]:
        """row or rack."""
        return "row" if self.rack is None else "rack"

    def seed(self, retained: Control, *, policy: Policy) -> None:
        """Start from the level a previous controller left in force (retained message).

        The level is clamped into the policy's range; the sequence continues from the
        retained one, bounded so a retained ``seq`` near the integer limit cannot make the
        next message unrepresentable.
        """
        if self.follow(retained, policy=policy):
            self.seeded_from = self.published_level

    def follow(self, leader: Control, *, policy: Policy) -> bool:
        """Take the level of another controller's message for this scope (a standby
        tracking its shard's leader, or ``seed``); whether the message is for this scope.

        A takeover then resumes at the leader's last level, never a lower one: the ladder
        takes the level (clamped) and starts its release dwell afresh.
        """
        if leader.row != self.row or (leader.rack or None) != self.rack:
            return False
        level = policy.clamp_level(leader.level)
        self.ladder = LadderState(level=level, below_since_s=None)
        self.published_level = level
        self.seq = max(self.seq, min(leader.seq, _MAX_SEEDED_SEQ))
        return True

    def step(
        self,
        *,
        power_w: float,
        budget_w: float,
        policy: Policy,
        revision: str,
        now_s: float,
        now_ns: int,
        lease_s: float,
        observe: bool,
        trend_w_per_s: float | None,
        inputs: dict[str, Any] | None = None,
        floor_level: int = 0,
        floor_reason: str = "",
    ) -> ScopeDecision:
        """Evaluate the scope once and build the control message that renews the lease.

        ``floor_level`` is a level forced from outside the ladder (a cooling emergency): the
        published level is the higher of the two, and the ladder itself is not touched, so
        when the floor drops the ordinary release rules (dwell, one step) apply.
        """
        top = policy.top_level
        # A reload may have removed levels since the last step: clamp what came before.
        previous = policy.clamp_level(self.published_level)
        if self.ladder.level > top:
            self.ladder = LadderState(level=top, below_since_s=self.ladder.below_since_s)
        budget_w = usable_budget_w(budget_w)
        ladder_before = self.ladder.level
        self.ladder = next_level(
            power_w=power_w,
            budget_w=budget_w,
            policy=policy,
            state=self.ladder,
            now_s=now_s,
            trend_w_per_s=trend_w_per_s,
        )
        level = max(self.ladder.level, policy.clamp_level(floor_level))
        if top > 0 and level == top > previous:
            self.brakes += 1
        self.published_level = level
        self.seq += 1
        pct = 100.0 * power_w / budget_w
        thresholds = tuple(budget_w * lvl.threshold_pct / 100.0 for lvl in policy.levels)
        name = level_name(policy, level)
        if level > self.ladder.level:
            reason = f"forced {name}: {floor_reason or 'external limit'}"
        elif level < previous and self.ladder.level >= ladder_before:
            reason = f"forced level lifted; {self.ladder.reason}"  # the floor dropped
        else:
            reason = self.ladder.reason
        reason = reason[:_REASON_CHARS]
        control = Control(
            ts_ns=now_ns,
            scope=self.scope,
            row=self.row,
            rack=self.rack,
            issuer=self.issuer,
            term=self.term,
            epoch_ns=self.epoch_ns,
            seq=self.seq,
            level=level,
            level_name=name,
            issued_ns=now_ns,
            lease_expires_ns=now_ns + int(lease_s * 1e9),
            policy_revision=revision,
            observe=observe,
            reason=reason,
        )
        audit = {
            "scope": self.scope,
            "row": self.row,
            "rack": self.rack,
            "previous_level": previous,
            "new_level": level,
            "ladder_level": self.ladder.level,
            "forced_level": floor_level,
            "level_name": name,
            "power_w": round(power_w, 1),
            "budget_w": round(budget_w, 1),
            "power_pct": round(pct, 2),
            "trend_w_per_s": None if trend_w_per_s is None else round(trend_w_per_s, 2),
            "thresholds_w": [round(t, 1) for t in thresholds],
            "margin_pct": policy.release.margin_pct,
            "dwell_s": policy.release.dwell_s,
            "policy_revision": revision,
            "term": self.term,
            "seq": self.seq,
            "observe": observe,
            "reason": reason,
            **(inputs or {}),
        }
        return ScopeDecision(
            control=control,
            level=level,
            level_name=name,
            previous_level=previous,
            changed=level != previous,
            power_pct=pct,
            thresholds_w=thresholds,
            audit=audit,
            brakes=self.brakes,
        )
