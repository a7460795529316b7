"""MQTT intake of the aggregator: route each message to its row, count and drop the bad.

Every received message is either applied to exactly one row's state or dropped with a
reason, counted and logged at a bounded rate (``polca.telemetry.checks.DropLog``: one
counter per reason, so a hostile publisher inventing topics grows no memory and cannot
flood the log). The reasons: ``oversized``, ``malformed`` (not JSON, the wrong shape or
types), ``schema_version``, ``topology`` (a node, rack or row this aggregator does not
own), ``identity`` (a payload naming another node, row, rack or CDU than its topic),
``stale`` (a reading delivered retained, so of unknown age), ``foreign_control`` (another
issuer, not a peer of our shard, controls one of our rows), and ``internal`` (an
unexpected error while handling one message: logged with its traceback; the intake
carries on).

Before a node's message is decoded it must pass that node's admission (token buckets per
node: telemetry apart from status, state and events, and payload bytes over all of them;
per topic for meters and CDUs; ``IntakeSettings``): a node sending faster is dropped
cheaply as ``rate_limited``, counted per node, so it cannot starve the other nodes, the
control step or the connection's keepalive. A telemetry message its row finds implausible
(``RowTracker.ingest_telemetry``: more power or GPUs than the node has) is still applied,
within the node's bound, and counted by reason (``implausible``); its warning, like
``node_offline``, is logged at most once per node per ``warn_every_s``.

Wall-clock stamps from other machines are never used for staleness (receipt time on the
monotonic clock is) and are trusted for the database only within the skew tolerance:
a message stamped further off is kept, counted under ``clock_skew`` (``skewed``) and
re-stamped with its time of receipt.

Telemetry, status and meter readings go into the row trackers; ``handle`` returns what
the caller must still route (``Accepted``: telemetry and events for the database, a
retained control of ours to seed a ladder, a control of a peer of our shard (high
availability: the leader's, which a standby follows), a CDU reading for the cooling supervisor, and
``urgent`` when a telemetry or meter reading took its row over the next threshold, so the
control step runs now rather than at the interval), so data flows one way. No I/O here.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Final, Literal, TypeVar

import structlog

from polca.aggregator.budgets import SiteBudgets
from polca.aggregator.config import IntakeSettings
from polca.aggregator.rollup import Anomaly, NodeView, RowTracker
from polca.coord.leadership import MAX_PLAUSIBLE_TERM
from polca.errors import SchemaError, StaleMessageError
from polca.telemetry.checks import ClockWindow, DropLog, RateGate, TokenBucket, check_identity
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import (
    MAX_PAYLOAD_BYTES,
    Budget,
    CduTelemetry,
    Control,
    Event,
    Meter,
    State,
    Status,
    Telemetry,
    decode,
)
from polca.telemetry.topics import NodeAddress, NodeChannel, Topics

NodeMoveKind = Literal["quarantined", "released"]
"""A node moved to the quarantine connection, or back to its shared one."""

_log = structlog.get_logger()
_NODE_CHANNELS: Final[tuple[NodeChannel, ...]] = ("telemetry", "status", "events")
"""What the aggregator reads of each node."""
_DEFAULT_WINDOW = ClockWindow.of_seconds(5.0)
_Stamped = TypeVar("_Stamped", Telemetry, Event)


@dataclass(frozen=True, slots=True)
class TelemetryIn:
    """A node's telemetry, applied to its row; for the database."""

    row: str
    rack: str
    node: str
    telemetry: Telemetry  # as counted: GPUs the node cannot have are cut out
    urgent: bool = False  # it took the row over its next threshold: step now
    anomalies: tuple[Anomaly, ...] = ()  # why it was implausible, if it was


@dataclass(frozen=True, slots=True)
class EventIn:
    """A node's event; for the database."""

    row: str
    rack: str
    node: str
    event: Event


@dataclass(frozen=True, slots=True)
class RetainedControl:
    """Our own control message, retained by a previous run: seeds a ladder."""

    control: Control


@dataclass(frozen=True, slots=True)
class PeerControl:
    """A control message of another instance of our shard (``ha.peers``): the leader's,
    which a standby follows; ``retained`` when delivered at subscription."""

    control: Control
    retained: bool


@dataclass(frozen=True, slots=True)
class CduIn:
    """A CDU reading, received at ``received_s`` (monotonic): for the cooling supervisor."""

    cdu: CduTelemetry
    received_s: float


@dataclass(frozen=True, slots=True)
class Urgent:
    """Step now: the row meter's reading took its row over the next threshold, a feed of
    the row went up or down, or a new leased budget came."""


URGENT: Final = Urgent()

Accepted = TelemetryIn | EventIn | RetainedControl | PeerControl | CduIn | Urgent
"""What ``Intake.handle`` accepted that its caller must route on."""


@dataclass(slots=True)
class Intake:
    """Decodes, checks and routes messages for the rows one aggregator owns."""

    site: str
    topics: Topics
    trackers: dict[str, RowTracker]
    issuer: str
    cdus: tuple[str, ...] = ()
    peers: frozenset[str] = frozenset()
    """The other instances of this shard (high availability): not foreign."""
    window: ClockWindow = _DEFAULT_WINDOW
    limits: IntakeSettings = field(default_factory=IntakeSettings)
    budgets: SiteBudgets | None = None
    """The rows' leased budgets and feeds (``budgets.py``): budget messages and the meters'
    feed states go there."""
    messages_in: int = 0
    drops: DropLog = field(init=False)
    skewed: DropLog = field(init=False)
    """Drops and skewed stamps, their log lines paced on the receipt times ``handle`` is
    given (no clock read here)."""
    implausible: Counter[str] = field(default_factory=Counter)
    """Implausible telemetry by reason (``rollup.Anomaly``), since start."""
    _meters: dict[str, str] = field(default_factory=dict)  # topic -> row
    _cdu_topics: dict[str, str] = field(default_factory=dict)  # topic -> CDU id
    _controls: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # topic -> scope
    _budget_topics: dict[str, str] = field(default_factory=dict)  # topic -> row
    # Admission, keyed by configured names only (nodes of the topology, meter and CDU
    # topics), created on first use: bounded by the configuration, never by the network.
    _buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    _now_s: float = 0.0  # the receipt time of the message being handled
    _warnings: RateGate = field(init=False)
    _moves: list[tuple[str, str, NodeMoveKind]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._warnings = RateGate(self.limits.warn_every_s)
        self.drops = DropLog(logger=_log, clock=self._received_s)
        self.skewed = DropLog("clock_skew_noted", logger=_log, clock=self._received_s)
        for name, tracker in self.trackers.items():
            topic = tracker.spec.meter_topic or self.topics.meter(self.site, name)
            self._meters[topic] = name
            self._controls[self.topics.row_control(self.site, name)] = (name, None)
            if self.budgets is not None and self.budgets.takes_budgets(name):
                self._budget_topics[self.topics.budget(self.site, name)] = name
            for rack in tracker.spec.racks:
                topic = self.topics.rack_control(self.site, name, rack.name)
                self._controls[topic] = (name, rack.name)
        for cdu in self.cdus:
            self._cdu_topics[self.topics.cdu(self.site, cdu)] = cdu

    @property
    def dropped(self) -> Counter[str]:
        """Dropped messages by reason."""
        return self.drops.counts

    def subscriptions(self) -> list[tuple[str, int]]:
        """The topic filters of the control connection: the owned rows' control (a
        previous run's, a peer's), which only aggregators may write (never ``#``), and the
        budgets of the rows that take the site controller's, which only it may write."""
        subs: list[tuple[str, int]] = []
        for row in self.trackers:
            subs.append((self.topics.row_control(self.site, row), 1))
            subs.append((self.topics.rack_control(self.site, row, "+"), 1))
        subs.extend((topic, 1) for topic in self._budget_topics)
        return subs

    def source_subscriptions(self) -> list[tuple[str, int]]:
        """The meters' and CDUs' topics: a connection of their own (their credentials are
        not the aggregators', and must not be able to delay control)."""
        return [(topic, 0) for topic in (*self._meters, *self._cdu_topics)]

    def node_topics(self, row: str, node: str) -> list[tuple[str, int]]:
        """What the aggregator reads of one node (at QoS 0, see ``node_subscriptions``)."""
        addr = NodeAddress(self.site, row, self.trackers[row].nodes[node].rack, node)
        return [(self.topics.node(addr, channel), 0) for channel in _NODE_CHANNELS]

    def node_subscriptions(self, connections: int) -> dict[str, list[tuple[str, int]]]:
        """The nodes' topics (telemetry, status, events) by connection: ``nodes-N`` for N
        below ``connections``, each node on one (``node_shard``), and ``quarantine``
        for the nodes moved off theirs (``NodeView.quarantined``). The broker's queue for a
        connection is shared by every node on it, so a flood fills one only.

        At QoS 0: a broker that drops QoS 1 messages to a connection whose queue is full
        (Mosquitto 2.0) stops delivering QoS 1 on it until it reconnects, which a
        connection that never publishes does not; with clean sessions QoS 1 would promise
        nothing polca relies on here.
        """
        shards: dict[str, list[tuple[str, int]]] = {
            f"nodes-{index}": [] for index in range(connections)
        }
        shards["quarantine"] = []
        for name, tracker in self.trackers.items():
            for node, view in tracker.nodes.items():
                shard = "quarantine" if view.quarantined else node_shard(node, connections)
                shards[shard].extend(self.node_topics(name, node))
        return shards

    def take_moves(self) -> list[tuple[str, str, NodeMoveKind]]:
        """The (row, node, kind) of nodes newly ``quarantined`` (over ``quarantine_after``
        refusals) or ``released`` (none refused for ``quarantine_release_s``), for the shell
        to move between connections (each once; ``node_subscriptions`` already lists them
        where they go)."""
        taken, self._moves = self._moves, []
        return taken

    def _received_s(self) -> float:
        """The receipt time of the message being handled (the drop logs' clock)."""
        return self._now_s

    def handle(self, message: InMessage, now_s: float) -> Accepted | None:
        """Apply one message to its row, or count and drop it; what to route on. Never raises.

        ``now_s`` is the monotonic time of receipt (staleness); the wall clock of receipt
        is ``message.received_ns``.
        """
        self.messages_in += 1
        self._now_s = now_s
        try:
            return self._route(message, now_s)
        except SchemaError as exc:
            self.drops.drop(exc.reason, topic=message.topic, detail=str(exc))
        except Exception as exc:  # one message must never end the intake
            self.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))
        return None

    def _route(self, message: InMessage, now_s: float) -> Accepted | None:
        if len(message.payload) > MAX_PAYLOAD_BYTES:
            self.drops.drop(
                "oversized", topic=message.topic, detail=f"{len(message.payload)} bytes"
            )
            return None
        if message.topic in self._meters:
            if not self._admit(message.topic, "source", message, now_s):
                return None
            return URGENT if self._meter(message, now_s) else None
        if message.topic in self._cdu_topics:
            if not self._admit(message.topic, "source", message, now_s):
                return None
            return self._cdu(message, now_s)
        if message.topic in self._controls:
            return self._control(message)
        if message.topic in self._budget_topics:
            return self._budget(message, now_s)
        parsed = self.topics.parse_node(message.topic)
        if parsed is None:
            self.drops.drop("topology", topic=message.topic, detail="not a topic polca reads")
            return None
        addr, channel = parsed
        tracker = self.trackers.get(addr.row) if addr.site == self.site else None
        if tracker is None or tracker.rack_of(addr.node) != addr.rack:
            self.drops.drop(
                "topology", topic=message.topic, detail="node not in this aggregator's topology"
            )
            return None
        kind = "telemetry" if channel == "telemetry" else "messages"
        if not self._admit(addr.node, kind, message, now_s, (addr.row, tracker.nodes[addr.node])):
            return None
        if not message.payload:
            return None  # a retained message being cleared
        if channel == "telemetry":
            telemetry = decode(message.payload, Telemetry)
            check_identity("node", payload=telemetry.node, topic=addr.node)
            _not_retained(message, "telemetry")
            telemetry = self._trusted(telemetry, message, channel)
            view = tracker.nodes[addr.node]
            learned = view.bound_source is not None
            ingested = tracker.ingest_telemetry(addr.node, telemetry, now_s)
            if not learned and view.bound_source in ("declared", "intake"):
                _log.warning(
                    "node_bound_declared",
                    row=addr.row,
                    node=addr.node,
                    source=view.bound_source,
                    gpus=view.gpu_count,
                    gpu_bound_w=view.gpu_bound_w,
                    product=telemetry.gpus[0].name[:64] if telemetry.gpus else None,
                    detail="the node's GPUs are not in polca's table of published power "
                    "limits: its bound rests on what it declares (at most "
                    "intake.max_gpu_power_w a GPU); set gpu_max_power_w or nameplate_w in "
                    "the topology",
                )
            if ingested.anomalies:
                self._implausible(addr.row, addr.node, telemetry, ingested.anomalies, now_s)
            return TelemetryIn(
                addr.row,
                addr.rack,
                addr.node,
                ingested.telemetry,
                ingested.urgent,
                ingested.anomalies,
            )
        if channel == "status":
            status = decode(message.payload, Status)
            check_identity("node", payload=status.node, topic=addr.node)
            tracker.ingest_status(addr.node, status)
            if status.state == "offline" and (
                times := self._warnings.admit(f"offline:{addr.node}", now_s)
            ):
                _log.warning(
                    "node_offline",
                    row=addr.row,
                    rack=addr.rack,
                    node=addr.node,
                    reason=status.reason,
                    times=times,
                )
            return None
        if channel == "events":
            event = decode(message.payload, Event)
            check_identity("node", payload=event.node, topic=addr.node)
            return EventIn(addr.row, addr.rack, addr.node, self._trusted(event, message, channel))
        if channel == "state":
            state = decode(message.payload, State)  # validated, kept by the broker for status
            check_identity("node", payload=state.node, topic=addr.node)
            return None
        self.drops.drop("topology", topic=message.topic, detail=f"{channel} is not read here")
        return None

    def _admit(
        self,
        source: str,
        kind: str,
        message: InMessage,
        now_s: float,
        node: tuple[str, NodeView] | None = None,
    ) -> bool:
        """Whether ``source`` (a node, or a meter or CDU topic) may send this message now.

        One bucket per source and kind, and one of payload bytes per source; refused
        messages are counted (``rate_limited``, and per node: ``node`` is its row and
        view) and cost no decoding. A node refused ``quarantine_after`` times is queued
        for ``take_moves`` as quarantined; a quarantined one whose message is admitted
        ``quarantine_release_s`` after its last refusal, as released.
        """
        limits = self.limits
        bucket = self._buckets.get((source, kind))
        if bucket is None:
            rate, burst = {
                "telemetry": (limits.telemetry_per_s, limits.telemetry_burst),
                "messages": (limits.messages_per_s, limits.messages_burst),
                "source": (limits.source_per_s, limits.source_burst),
            }[kind]
            bucket = self._buckets[(source, kind)] = TokenBucket(rate, burst)
        volume = self._buckets.get((source, "bytes"))
        if volume is None:
            volume = TokenBucket(limits.bytes_per_s, limits.bytes_burst)
            self._buckets[(source, "bytes")] = volume
        if bucket.take(1, now_s) and volume.take(len(message.payload), now_s):
            if node is not None and node[1].quarantined:
                self._maybe_release(node[0], source, node[1], now_s)
            return True
        if node is not None:
            row, view = node
            view.rate_limited += 1
            view.flood_refusals += 1
            view.refused_s = now_s
            if view.flood_refusals >= limits.quarantine_after and not view.quarantined:
                view.quarantined = True
                self._moves.append((row, source, "quarantined"))
                _log.warning(
                    "node_quarantined",
                    row=row,
                    node=source,
                    rate_limited=view.rate_limited,
                    hint="its topics move to a connection of their own: it floods its row's "
                    "broker (a bug, or its credentials in someone else's hands)",
                )
        self.drops.drop(
            "rate_limited", topic=message.topic, detail=f"{source} over its {kind} rate"
        )
        return False

    def _maybe_release(self, row: str, node: str, view: NodeView, now_s: float) -> None:
        """Move a quarantined node back once it sent no refused message for the release
        time: the fault cleared (its flood stopped), so it shares a connection again."""
        quiet_s = now_s - (view.refused_s if view.refused_s is not None else now_s)
        if quiet_s < self.limits.quarantine_release_s:
            return
        view.quarantined = False
        view.flood_refusals = 0
        view.releases += 1
        self._moves.append((row, node, "released"))
        _log.info(
            "node_released",
            row=row,
            node=node,
            quiet_s=round(quiet_s, 1),
            rate_limited=view.rate_limited,
            releases=view.releases,
        )

    def _implausible(
        self,
        row: str,
        node: str,
        telemetry: Telemetry,
        anomalies: tuple[Anomaly, ...],
        now_s: float,
    ) -> None:
        """Count an implausible reading; warn at most once per node per interval."""
        self.implausible.update(anomalies)
        times = self._warnings.admit(f"implausible:{node}", now_s)
        if not times:
            return
        view = self.trackers[row].nodes[node]
        _log.warning(
            "telemetry_implausible",
            row=row,
            node=node,
            reasons=list(anomalies),
            claimed_gpu_w=telemetry.node_gpu_power_w,
            gpus_listed=len(telemetry.gpus),
            gpus_allowed=view.gpu_count,
            gpu_bound_w=view.gpu_bound_w,
            counted_w=round(view.counted_w, 1),
            times=times,
        )

    def _trusted(self, message: _Stamped, raw: InMessage, channel: str) -> _Stamped:
        """The message, re-stamped with its receipt time when its own stamp is skewed."""
        if not self.window.skewed(message.ts_ns, raw.received_ns):
            return message
        ahead_s = (message.ts_ns - raw.received_ns) / 1e9
        self.skewed.drop(channel, topic=raw.topic, detail=f"stamp {ahead_s:+.1f} s off")
        return message.model_copy(update={"ts_ns": raw.received_ns})

    def _meter(self, message: InMessage, now_s: float) -> bool:
        meter = decode(message.payload, Meter)
        _not_retained(message, "meter reading")
        if self.window.skewed(meter.ts_ns, message.received_ns):
            self.skewed.drop("meter", topic=message.topic, detail="meter stamp off")
        row = self._meters[message.topic]
        feeds_changed = self.budgets is not None and self.budgets.note_meter(row, meter)
        return self.trackers[row].ingest_meter(meter, now_s) or feeds_changed

    def _budget(self, message: InMessage, now_s: float) -> Urgent | None:
        """A leased budget for one of our rows: taken (a step now when it moved the row's
        budget) or counted and dropped."""
        if not message.payload or self.budgets is None:
            return None  # a retained budget being cleared: the lease runs out on its own
        budget = decode(message.payload, Budget)
        check_identity("row", payload=budget.row, topic=self._budget_topics[message.topic])
        verdict = self.budgets.offer(
            budget,
            received_mono_ns=message.received_mono_ns or round(now_s * 1e9),
            received_wall_ns=message.received_ns,
            retained=message.retain,
        )
        if verdict != "granted":
            self.drops.drop(
                f"budget_{verdict}",
                topic=message.topic,
                detail=f"issuer {budget.issuer!r} term {budget.term} seq {budget.seq}",
            )
            return None
        return URGENT if self.budgets.moved else None  # a renewal needs no step of its own

    def _cdu(self, message: InMessage, now_s: float) -> CduIn:
        cdu = decode(message.payload, CduTelemetry)
        check_identity("cdu", payload=cdu.cdu, topic=self._cdu_topics[message.topic])
        _not_retained(message, "CDU reading")
        if self.window.skewed(cdu.ts_ns, message.received_ns):
            self.skewed.drop("cdu", topic=message.topic, detail="CDU stamp off")
        return CduIn(cdu, now_s)

    def _control(self, message: InMessage) -> RetainedControl | PeerControl | None:
        if not message.payload:
            return None
        control = decode(message.payload, Control)
        row, rack = self._controls[message.topic]
        check_identity("row", payload=control.row, topic=row)
        check_identity("rack", payload=control.rack, topic=rack)
        if control.term > MAX_PLAUSIBLE_TERM:
            # Forged: it may neither depose our leader nor, retained under our own name,
            # seed a restarted ladder (a brake left on the topic would be taken up).
            self.drops.drop(
                "term_jump", topic=message.topic, detail=f"term {control.term} is forged"
            )
            return None
        if control.issuer in self.peers:
            return PeerControl(control, message.retain)
        if control.issuer != self.issuer:
            self.drops.drop(
                "foreign_control", topic=message.topic, detail=f"issuer {control.issuer!r}"
            )
            return None
        return RetainedControl(control) if message.retain else None


def node_shard(node: str, connections: int) -> str:
    """The name of the intake connection (of ``connections``) that carries ``node``'s topics
    until it is quarantined (stable: a hash of its name)."""
    return f"nodes-{zlib.crc32(node.encode()) % connections}"


def _not_retained(message: InMessage, what: str) -> None:
    """Readings are live: one delivered retained has no known age and is dropped."""
    if message.retain:
        msg = f"a retained {what} is of unknown age"
        raise StaleMessageError(msg)
