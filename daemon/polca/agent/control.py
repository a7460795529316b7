"""Which control messages the agent believes, and the lease they grant.

The row controller publishes retained control messages at row and rack scope. This module
keeps the newest valid one per scope and answers "what level is in force now, until when?".
A message is ignored (and counted) when it is for another row or rack, older than or equal
to the last accepted one of its scope (by ``(epoch_ns, seq)``), or already expired. A
message in shadow mode (``observe``) is tracked for logging but never raises the level.

Pure logic with no I/O: the runtime feeds it decoded messages and the current time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from polca.telemetry.schema import Control

Verdict = Literal["accepted", "stale", "expired", "foreign", "observed"]


@dataclass(frozen=True, slots=True)
class Lease:
    """One accepted control message and when its lease ends on this node's clock."""

    control: Control
    expires_ns: int


@dataclass(slots=True)
class ControlTracker:
    """The newest accepted control per scope, for one node."""

    row: str
    rack: str
    row_lease: Lease | None = None
    rack_lease: Lease | None = None
    rejected: int = 0
    last_verdict: Verdict | None = None
    _order: dict[str, tuple[int, int]] = field(default_factory=dict)

    def offer(self, control: Control, *, received_ns: int) -> Verdict:
        """Consider one control message received at ``received_ns`` (Unix ns)."""
        verdict = self._judge(control, received_ns=received_ns)
        self.last_verdict = verdict
        if verdict in ("stale", "expired", "foreign"):
            self.rejected += 1
            return verdict
        key = control.scope
        self._order[key] = (control.epoch_ns, control.seq)
        if verdict == "observed":
            return verdict
        # Skew guard: never hold the lease longer after receipt than it was granted for.
        granted_ns = max(0, control.lease_expires_ns - control.issued_ns)
        lease = Lease(control, min(control.lease_expires_ns, received_ns + granted_ns))
        if control.scope == "row":
            self.row_lease = lease
        else:
            self.rack_lease = lease
        return verdict

    def _judge(self, control: Control, *, received_ns: int) -> Verdict:
        if control.row != self.row or (control.scope == "rack" and control.rack != self.rack):
            return "foreign"
        last = self._order.get(control.scope)
        if last is not None and (control.epoch_ns, control.seq) <= last:
            return "stale"
        if control.lease_expires_ns <= received_ns:
            return "expired"
        if control.observe:
            return "observed"
        return "accepted"

    def active(self, now_ns: int) -> list[Lease]:
        """The leases still valid at ``now_ns``."""
        return [
            lease
            for lease in (self.row_lease, self.rack_lease)
            if lease is not None and lease.expires_ns > now_ns
        ]

    def current(self, now_ns: int) -> Lease | None:
        """The lease in force: the highest level among valid scopes, else the latest one.

        Returns the expired lease with the latest expiry when none is valid (so callers can
        tell "lease expired" from "never had one"), or None when nothing was ever accepted.
        """
        valid = self.active(now_ns)
        if valid:
            return max(valid, key=lambda lease: (lease.control.level, lease.expires_ns))
        leases = [lease for lease in (self.row_lease, self.rack_lease) if lease is not None]
        return max(leases, key=lambda lease: lease.expires_ns) if leases else None
