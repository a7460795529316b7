"""Who controls a shard's rows, and until when: the leader's side of fencing (pure).

Several aggregators may be configured for the same rows (a *shard*); one leads, elected
through an etcd lease (``polca.coord.etcd``), and only the leader publishes control. This
module is the state the runtime asks before every control message: ``may_publish(now)``.

Time discipline: etcd expires a lease ``ttl`` after it *received* the last keepalive, which
is after this process *sent* it; so the lease cannot end before ``sent + ttl`` on any
clock that runs at the rate of etcd's. The leader counts its own deadline from the send
time, on its monotonic clock, less a safety fraction (``SAFETY_FRACTION``) for clock-rate
differences: a leader cut off from etcd (partition, quorum lost, a paused process) stops
publishing before anyone else can have been elected. A standby is elected only after etcd
deleted the old leader's key, so two leaders never publish at once.

The term is the etcd revision at which the leader created its leadership key: every new
leader's is higher than every earlier one's (etcd's revisions only grow), so agents can
follow the highest term and ignore a deposed leader (``polca.agent.control``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["alone", "standby", "leader"]
SAFETY_FRACTION = 0.8
"""The share of the lease ttl a leader trusts after a keepalive was sent."""


@dataclass(slots=True)
class Leadership:
    """The leadership of one shard as this process knows it.

    Without etcd (``alone``) it always may publish, with term 0, as before high
    availability existed.
    """

    role: Role = "alone"
    term: int = 0
    leader: str | None = None
    """The instance that leads, as etcd last said (this one when leading)."""
    leader_term: int = 0
    """The term of that leader (etcd's create revision of the key)."""
    deadline_mono_ns: int = 0
    changes: int = 0

    @classmethod
    def standby(cls) -> Leadership:
        """A member of a shard that has not been elected (yet)."""
        return cls(role="standby")

    def may_publish(self, now_mono_ns: int) -> bool:
        """Whether control may go out now: alone, or leading within the lease."""
        if self.role == "alone":
            return True
        return self.role == "leader" and now_mono_ns < self.deadline_mono_ns

    def elected(self, *, term: int, instance: str, sent_mono_ns: int, ttl_s: float) -> bool:
        """This process won the key at ``term`` (its request sent at ``sent_mono_ns``).

        Returns whether the role changed (a new term is a change too).
        """
        changed = self.role != "leader" or self.term != term
        self.role, self.term = "leader", term
        self.leader, self.leader_term = instance, term
        self.renewed(sent_mono_ns=sent_mono_ns, ttl_s=ttl_s)
        if changed:
            self.changes += 1
        return changed

    def renewed(self, *, sent_mono_ns: int, ttl_s: float) -> None:
        """A keepalive sent at ``sent_mono_ns`` was answered with the lease alive."""
        deadline = sent_mono_ns + int(ttl_s * SAFETY_FRACTION * 1e9)
        self.deadline_mono_ns = max(self.deadline_mono_ns, deadline)

    def lost(self) -> bool:
        """The lease is gone (expired, revoked, or its deadline passed): stop leading.

        Returns whether this process was leading.
        """
        was = self.role == "leader"
        if self.role != "alone":
            self.role = "standby"
        self.deadline_mono_ns = 0
        if was:
            self.changes += 1
            if self.leader_term == self.term:
                self.leader = None
        return was

    def observed(self, *, leader: str | None, term: int) -> None:
        """Who etcd says leads (a standby's view; ``None`` when the key is free)."""
        self.leader, self.leader_term = leader, term
