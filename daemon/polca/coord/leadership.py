"""Who controls a shard's rows, and until when: the leader's side of fencing (pure).

Several aggregators may be configured for the same rows (a *shard*); one leads, elected
through an etcd lease (``polca.coord.etcd``), and only the leader publishes control. This
module is the state the aggregator's core asks before every control step's messages:
``may_publish(now_mono_ns)`` (``aggregator/core.py`` ``AggregatorCore.step``).

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

The rules the aggregator applies around the election live here too, so a test states
them without a process: a standby writes none of the rows' series (``writes_row_series``),
follows the leader's control and steps down when a peer publishes at a higher term
(``peer_control``), and what a change of leadership asks of the shell (``changed``: stamp
the term and step at once, audit a new leader once). No I/O, no clock reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

Role = Literal["alone", "standby", "leader"]
PeerVerdict = Literal["follow", "ignore", "deposed"]
"""What a peer's control message means for this instance (``Leadership.peer_control``)."""
SAFETY_FRACTION = 0.8
"""The share of the lease ttl a leader trusts after a keepalive was sent."""


MAX_PLAUSIBLE_TERM: Final = 2**40
"""No real leadership term is above this: terms are etcd create-revisions, and the etcd
cluster the aggregators elect on does not reach a trillion writes. A control stamped with
a higher term is forged (an agent refuses it, ``agent.max_term``; an aggregator does not let
it depose its leader)."""


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
    audited: tuple[str | None, int] = (None, 0)
    """The (leader, leader term) last audited (``changed``): each is audited once."""

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

    @property
    def writes_row_series(self) -> bool:
        """Whether the rows' series (GPU points, the step's row, rack and node points) are
        this instance's to write: not a standby's, the leader writes them. Points need no
        fencing: a leader cut off from etcd still writes them until it learns it lost."""
        return self.role != "standby"

    def peer_control(self, term: int, *, retained: bool) -> PeerVerdict:
        """Another instance of the shard published control at ``term``: what to do.

        A leader is ``deposed`` by a live (not retained) control of a higher term: a newer
        leader exists, so its own lease is gone though etcd has not said so yet; it stops
        leading at once (``lost``). Anything else a leader ignores. A standby (or an
        instance alone) follows the leader's level when the term is at least the leader
        term it knows, and always a retained one (the last control before it started).
        """
        if self.role == "leader":
            if term > self.term and not retained:
                self.lost()
                return "deposed"
            return "ignore"
        if term >= self.leader_term or retained:
            return "follow"
        return "ignore"

    def status(self, shard: str) -> dict[str, object]:
        """The ``ha`` part of the instance's retained status: its role and the term it
        knows (its own when leading, else the leader's)."""
        return {
            "shard": shard,
            "role": self.role,
            "term": self.term if self.role == "leader" else self.leader_term,
            "leader": self.leader,
        }

    def changed(self, shard: str) -> LeadershipChange:
        """The elector (or a deposition) changed the leadership: what the shell does.

        Always a log line (``LeadershipChange.detail``); when leading, the term to stamp
        on every control from now on and a step at once (the new term's first control
        goes out now); an audit (event and point) once per new (leader, leader term).
        """
        seen = (self.leader, self.leader_term)
        audit = seen != self.audited
        self.audited = seen
        return LeadershipChange(
            shard=shard,
            role=self.role,
            term=self.term,
            leader=self.leader,
            leader_term=self.leader_term,
            audit=audit,
        )


@dataclass(frozen=True, slots=True)
class LeadershipChange:
    """A change of leadership as the shell reports it (``Leadership.changed``)."""

    shard: str
    role: Role
    term: int
    leader: str | None
    leader_term: int
    audit: bool
    """A new leader or term: publish the ``leader_changed`` event, write the point."""

    @property
    def lead_term(self) -> int | None:
        """Leading at this term: stamp it on every control and step now; None otherwise."""
        return self.term if self.role == "leader" else None

    @property
    def detail(self) -> dict[str, object]:
        """The fields of the log line, the audit event and the point."""
        return {
            "shard": self.shard,
            "role": self.role,
            "term": self.term,
            "leader": self.leader,
            "leader_term": self.leader_term,
        }
