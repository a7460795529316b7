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

A message is refused (and counted) when it is:

- ``foreign``: for another row or rack;
- ``issuer``: from an issuer the row does not name (``agent.control_issuers``);
- ``fenced``: from a leadership ``term`` lower than the highest this node has accepted (a
  deposed aggregator that still publishes: paused, partitioned); a lower term is accepted
  again only once every lease of the higher one has run out (an etcd cluster rebuilt from
  scratch restarts its revisions), so no term can lock the real controller out;
- ``term_jump``: from a term more than ``max_term_step`` (``agent.max_term_step``) above the
  highest accepted, while a lease of that highest term is still valid. Terms are etcd
  create-revisions, which grow with the cluster's writes, so a real new leader's term is
  above the old one's by a plausible step; a term far above the highest term seen in this
  process's lifetime is accepted only after the lease of the current term lapses (bounding
  a forged term to one lease, as epochs are), and a live controller renewing its lease
  cannot be fenced out by one. A term above ``max_term`` (``agent.max_term``, 2**40) is
  refused always, the first one this node sees included: no etcd cluster polca elects on
  reaches that revision (a trillion writes), so such a term is forged, and a forged first
  message cannot fence out the real controller that comes after it;
- ``stale``: not newer, by ``(epoch_ns, seq)``, than the last one accepted for its scope;
  a *lower* epoch (a controller restarted after its clock stepped back) is accepted once
  the higher epoch's lease has run out, so no stamp can lock the real controller out;
- ``future``: its ``epoch_ns`` (the issuer's start) lies beyond the tolerance in the future
  of both this clock and the message's own ``issued_ns`` (either clock may be skewed or
  have stepped, not both at once), or a retained message was issued beyond the tolerance
  in the future of this clock;
- ``skewed``: a live message whose stamp is more than ``MAX_PLAUSIBLE_SKEW_NS`` (a week)
  from this clock: no real clock is that far off, so the stamps are forged or broken.
  Together with the rule above this bounds every epoch to this clock plus a week, and the
  restart rule bounds what a bogus epoch can do to one lease;
- ``expired``: it grants no time (a lease that ends before it was issued, or a retained
  message older than its lease).

A message in shadow mode (``observe``) is tracked for logging but never sets the level.
Pure logic with no I/O: the core's message intake (``intake.py`` ``MessageIntake``) feeds
it decoded messages and the times of receipt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from polca.coord.leadership import MAX_PLAUSIBLE_TERM
from polca.telemetry.checks import ClockWindow
from polca.telemetry.schema import Control

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
DEFAULT_MAX_TERM_STEP = 2**32
"""A term more than this above the highest accepted waits for that term's lease to lapse."""
DEFAULT_MAX_TERM = MAX_PLAUSIBLE_TERM
"""No real leadership term is above this (an etcd revision: a trillion writes)."""
MAX_PLAUSIBLE_SKEW_NS = 7 * 86_400 * 1_000_000_000
"""Beyond this, a live message's stamp is not a skewed clock but a forged or broken one."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One accepted control message and when its lease ends on this node's monotonic clock."""

    control: Control
    expires_mono_ns: int


@dataclass(frozen=True, slots=True)
class _Order:
    term: int
    epoch_ns: int
    seq: int
    expires_mono_ns: int


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
    term: int = 0
    """The highest leadership term accepted (0: no high availability)."""
    _order: dict[str, _Order] = field(default_factory=dict)

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
        self._order[control.scope] = _Order(control.term, control.epoch_ns, control.seq, expires)
        self.term = control.term  # the highest, or a lower one once the higher lapsed
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
        newest_clock_ns = max(received_wall_ns, control.issued_ns)
        if control.epoch_ns - newest_clock_ns > self.window.tolerance_ns:
            return "future", 0
        if not retained and abs(received_wall_ns - control.issued_ns) > MAX_PLAUSIBLE_SKEW_NS:
            return "skewed", 0
        if control.term < self.term and any(
            order.expires_mono_ns > received_mono_ns for order in self._order.values()
        ):
            return "fenced", 0
        if control.term > self.max_term:
            return "term_jump", 0
        if control.term - self.term > self.max_term_step and any(
            order.term == self.term and order.expires_mono_ns > received_mono_ns
            for order in self._order.values()
        ):
            return "term_jump", 0
        last = self._order.get(control.scope)
        if last is not None and control.term != last.term:
            last = None  # a new leader (or, the higher term lapsed, a rebuilt etcd's)
        if last is not None and (control.epoch_ns, control.seq) <= (last.epoch_ns, last.seq):
            restarted = control.epoch_ns < last.epoch_ns
            if not (restarted and last.expires_mono_ns <= received_mono_ns):
                return "stale", 0
        granted_ns = min(control.lease_expires_ns - control.issued_ns, max_lease_ns)
        if retained:
            age_ns = received_wall_ns - control.issued_ns
            if age_ns < -self.window.tolerance_ns:
                return "future", 0
            granted_ns -= max(0, age_ns)
        if granted_ns <= 0:
            return "expired", 0
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
