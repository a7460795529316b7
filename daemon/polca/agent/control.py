"""Which control messages the agent believes, and the lease they grant.

The row controller publishes retained control messages at row and rack scope. This module
keeps the newest valid one per scope and answers "what level is in force now, until when?".

Time discipline: a lease runs on this node's **monotonic** clock from the moment the
message was received, for the duration the controller granted (``lease_expires_ns -
issued_ns``), cut to the policy's ``fail_safe.max_lease_s``. Wall clocks (the controller's
stamps, this node's ``time.time_ns()``) are never subtracted to make a duration, with one
exception that cannot be avoided: a *retained* message delivered at subscription may have
been issued long ago, so its age is judged by the wall clocks, within the skew tolerance;
if it looks older than its lease it grants nothing (the controller's next live message,
every control interval, will). A live message (MQTT clears the retain flag on delivery to
an established subscription) was just issued, whatever its stamp says: it is followed even
when the two clocks disagree, and the disagreement is measured (``skew_ns``) so the agent
can say so. A clock step on either side therefore neither expires a valid lease nor
extends one.

A message is refused (and counted) when it is ``foreign`` (for another row or rack) or
from an ``issuer`` the row does not name (``agent.control_issuers``); above that it is
ordered, fenced and leased by ``coord/fencing.py`` ``LeaseFence``, per scope, with the
rules and verdicts written there (``future``, ``skewed``, ``fenced``, ``term_jump``
beyond ``agent.max_term_step`` or above ``agent.max_term``, ``stale``, ``expired``), the
same rules the aggregator applies to the site controller's budgets.

A message in shadow mode (``observe``) is tracked for logging but never sets the level.
Pure logic with no I/O: the core's message intake (``intake.py`` ``MessageIntake``) feeds
it decoded messages and the times of receipt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from polca.coord.fencing import DEFAULT_MAX_TERM, DEFAULT_MAX_TERM_STEP, LeaseFence, Stamp
from polca.telemetry.checks import ClockWindow
from polca.telemetry.schema import Control

__all__ = ["REFUSED", "ControlTracker", "Lease", "Verdict", "stamp_of"]

Verdict = Literal[
    "accepted",
    "observed",
    "stale",
    "expired",
    "foreign",
    "issuer",
    "future",
    "skewed",
    "fenced",
    "term_jump",
]
REFUSED: frozenset[Verdict] = frozenset(
    {"stale", "expired", "foreign", "issuer", "future", "skewed", "fenced", "term_jump"}
)


@dataclass(frozen=True, slots=True)
class Lease:
    """One accepted control message and when its lease ends on this node's monotonic clock."""

    control: Control
    expires_mono_ns: int


def stamp_of(control: Control) -> Stamp:
    """What orders and leases a control message."""
    return Stamp(
        control.term, control.epoch_ns, control.seq, control.issued_ns, control.lease_expires_ns
    )


@dataclass(slots=True)
class ControlTracker:
    """The newest accepted control per scope, for one node.

    ``issuers`` empty accepts any issuer (the core warns about it at start-up,
    ``AgentCore.discovered``);
    ``max_term_step`` bounds the term a control may jump to while the current term's lease
    runs (``agent.max_term_step``); ``max_term`` any term (``agent.max_term``).
    """

    row: str
    rack: str
    window: ClockWindow
    issuers: frozenset[str] = frozenset()
    max_term_step: int = DEFAULT_MAX_TERM_STEP
    max_term: int = DEFAULT_MAX_TERM
    row_lease: Lease | None = None
    rack_lease: Lease | None = None
    rejected: int = 0
    last_verdict: Verdict | None = None
    skew_ns: int | None = None  # receipt wall clock - issued_ns of the last live message
    _fence: LeaseFence = field(init=False)

    def __post_init__(self) -> None:
        """The fence of this node's scopes."""
        self._fence = LeaseFence(
            self.window, max_term_step=self.max_term_step, max_term=self.max_term
        )

    @property
    def term(self) -> int:
        """The highest leadership term accepted (0: no high availability)."""
        return self._fence.term

    def offer(
        self,
        control: Control,
        *,
        received_mono_ns: int,
        received_wall_ns: int,
        retained: bool,
        max_lease_ns: int,
    ) -> Verdict:
        """Consider one control message received at these times (monotonic and Unix ns)."""
        verdict, remaining_ns = self._judge(
            control,
            received_mono_ns=received_mono_ns,
            received_wall_ns=received_wall_ns,
            retained=retained,
            max_lease_ns=max_lease_ns,
        )
        self.last_verdict = verdict
        if verdict in REFUSED:
            self.rejected += 1
            return verdict
        if not retained:
            self.skew_ns = received_wall_ns - control.issued_ns
        expires = received_mono_ns + remaining_ns
        self._fence.accept(control.scope, stamp_of(control), expires_mono_ns=expires)
        if verdict == "observed":
            return verdict
        lease = Lease(control, expires)
        if control.scope == "row":
            self.row_lease = lease
        else:
            self.rack_lease = lease
        return verdict

    def _judge(
        self,
        control: Control,
        *,
        received_mono_ns: int,
        received_wall_ns: int,
        retained: bool,
        max_lease_ns: int,
    ) -> tuple[Verdict, int]:
        if control.row != self.row or (control.scope == "rack" and control.rack != self.rack):
            return "foreign", 0
        if self.issuers and control.issuer not in self.issuers:
            return "issuer", 0
        verdict, granted_ns = self._fence.judge(
            control.scope,
            stamp_of(control),
            received_mono_ns=received_mono_ns,
            received_wall_ns=received_wall_ns,
            retained=retained,
            max_lease_ns=max_lease_ns,
        )
        if verdict != "granted":
            return verdict, 0
        return ("observed" if control.observe else "accepted"), granted_ns

    def active(self, now_mono_ns: int) -> list[Lease]:
        """The leases still valid at ``now_mono_ns``."""
        return [
            lease
            for lease in (self.row_lease, self.rack_lease)
            if lease is not None and lease.expires_mono_ns > now_mono_ns
        ]

    def current(self, now_mono_ns: int) -> Lease | None:
        """The lease in force: the highest level among valid scopes, else the latest one.

        Returns the expired lease with the latest expiry when none is valid (so callers can
        tell "lease expired" from "never had one"), or None when nothing was ever accepted.
        """
        valid = self.active(now_mono_ns)
        if valid:
            return max(valid, key=lambda lease: (lease.control.level, lease.expires_mono_ns))
        leases = [lease for lease in (self.row_lease, self.rack_lease) if lease is not None]
        return max(leases, key=lambda lease: lease.expires_mono_ns) if leases else None
