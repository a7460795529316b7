"""Per-row bookkeeping: node, rack and row power, energy and temperatures (pure).

Fed with decoded messages and the monotonic time of receipt; asked for a ``RowRollup`` at
each control interval. How a node counts:

- **fresh** (telemetry within ``stale_after_s``): its GPUs' mean power over the last
  interval, times ``1 + non_gpu_factor``, plus ``non_gpu_w``;
- **stale** (no telemetry for ``stale_after_s``), **offline** (its Last Will or a clean stop
  said so) or **unknown** (never heard from): its *nameplate*, the conservative value:
  ``nameplate_w`` from the topology when set, else the sum of its GPUs' enforced power
  limits from its last telemetry plus its non-GPU power, else 0 for a node never heard
  from (such a node is listed, so operators see the gap). A node whose agent is down may
  still draw power: counting it at its limits errs on the side of capping.

A node's GPU power is the larger of its reported sum and the sum of its GPUs' readings, so a
node cannot under-report by contradicting itself. Nor can it over-report beyond what it can
draw (``IntakeSettings``): its GPU count and per-GPU maximum are fixed by the topology
(``gpus``, ``gpu_max_power_w``) or its first telemetry (cut to the site's maxima); a
reading above that bound, or above a declared ``nameplate_w``, is implausible and counted at
the bound (never below its last plausible reading: fail safe, not open); GPUs beyond the
count, or new GPU identities beyond twice the count, are cut from the message. The same
bound holds an offline or stale node's last claim. A fresh meter reading (``meter_topic``)
replaces the computed row power when its witness (``witness.py``) believes it: not above
what the row can draw, not below the whole-node power its fresh nodes report less a
tolerance, not frozen while the nodes move, and not within the hold after a refusal (then
it is only a floor under the computed power); ``RowRollup.meter`` says how it was judged.
A partial meter reading (one of the row's sources failed, ``polca meter``) is never used:
the computed power is, and ``RowRollup.meter_partial`` says which sources failed.
Otherwise the sum of the nodes is used. The row power history feeds a least-squares trend
(W/s) for the controller's brake-on-trend rule.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from polca.aggregator.config import IntakeSettings, NodeSpec, RowSpec
from polca.aggregator.witness import MeterJudgement, MeterWitness, TrustChange
from polca.gpu.products import published_max_power_w
from polca.policy import trend
from polca.telemetry.schema import GpuTelemetry, Meter, Status, Telemetry

NodeHealth = Literal["fresh", "stale", "offline", "unknown"]
BoundSource = Literal["topology", "product", "declared", "intake"]
"""Where a node's per-GPU bound came from: the topology's ``gpu_max_power_w``, the table of
published limits, the node's own declared maximum (cut to the intake's), or the intake's."""
Anomaly = Literal["power", "gpu_list", "gpu_identity"]
"""Why a telemetry message was implausible: a claim above the node's bound (``power``),
more GPUs than the node has (``gpu_list``), or GPU identities beyond what it can have
(``gpu_identity``: new indices or UUIDs, or one index listed twice)."""
IDENTITIES_PER_GPU = 2
"""Distinct (index, UUID) pairs a node may use per GPU over an aggregator's life: room for
a GPU replaced in maintenance, none for a stream of invented ones (each a new series)."""


@dataclass(frozen=True, slots=True)
class Ingested:
    """One telemetry message taken by a row: what it crossed and what was wrong with it."""

    telemetry: Telemetry
    """As counted: GPUs the node cannot have are cut out."""
    urgent: bool = False
    """It took the row over the armed threshold (``RowTracker.arm``)."""
    anomalies: tuple[Anomaly, ...] = ()


@dataclass(slots=True)
class NodeView:
    """What the aggregator knows of one node."""

    spec: NodeSpec
    rack: str
    telemetry: Telemetry | None = None
    received_s: float | None = None
    status: Literal["online", "offline"] | None = None
    limits_w: float | None = None  # sum of the GPUs' enforced limits, last telemetry
    gpu_power_w: float = 0.0  # the larger of the reported sum and the GPUs' own readings
    counted_w: float = 0.0  # its share of the row's power estimate between steps
    gpu_count: int | None = None  # GPUs it may list: the topology's, or its first report's
    gpu_bound_w: float | None = None  # the most its GPUs together can draw (with headroom)
    identities: set[tuple[int, str]] = field(default_factory=set)  # (index, uuid) seen
    implausible_s: float | None = None  # when its last implausible telemetry came
    implausible_readings: int = 0  # implausible telemetry messages since start
    plausible_gpu_w: float = 0.0  # its last plausible GPU power
    rate_limited: int = 0  # its messages the intake refused (admission), since start
    quarantined: bool = False  # moved to a connection of its own for flooding
    flood_refusals: int = 0  # refusals towards quarantine_after, since its last release
    refused_s: float | None = None  # its last refused message (receipt time)
    releases: int = 0  # times it was moved back from the quarantine connection
    bound_source: BoundSource | None = None  # where its GPU bound came from (``learn``)

    def nameplate_w(self) -> float:
        """The conservative power of this node when its telemetry cannot be trusted."""
        if self.spec.nameplate_w is not None:
            return self.spec.nameplate_w
        if self.limits_w is None:
            return 0.0
        return self._node_w(self.limits_w)

    def gpu_ceiling_w(self) -> float:
        """The most GPU power it is counted at: its bound, never below its last plausible
        reading (fail safe, not open); 0 before it reported any GPU."""
        return max(self.gpu_bound_w or 0.0, self.plausible_gpu_w)

    def _with_non_gpu_w(self, gpu_w: float) -> float:
        return gpu_w * (1 + self.spec.non_gpu_factor) + self.spec.non_gpu_w

    def _node_w(self, gpu_w: float) -> float:
        """Node power from GPU power: the non-GPU share added, within the plausible bound."""
        power_w = self._with_non_gpu_w(min(gpu_w, self.gpu_ceiling_w()))
        if self.spec.nameplate_w is not None:
            power_w = min(power_w, self.spec.nameplate_w)
        return power_w

    def max_w(self, bounds: IntakeSettings) -> float:
        """The most this node can draw, non-GPU power included: its nameplate, else its
        GPUs' plausible bound (before its first report: the topology's GPU count and
        maximum, else the intake's) with its non-GPU power."""
        if self.spec.nameplate_w is not None:
            return self.spec.nameplate_w
        if self.gpu_bound_w is not None:
            return self._with_non_gpu_w(self.gpu_ceiling_w())
        count = self.spec.gpus or bounds.max_gpus_per_node
        per_gpu_w = self.spec.gpu_max_power_w or bounds.max_gpu_power_w
        return self._with_non_gpu_w(count * per_gpu_w * (1 + bounds.power_headroom_fraction))

    def plausible(self, gpu_w: float) -> bool:
        """Whether a GPU power claim is within what the node can draw (and its nameplate)."""
        if gpu_w > self.gpu_ceiling_w():
            return False
        nameplate_w = self.spec.nameplate_w
        return nameplate_w is None or self._with_non_gpu_w(gpu_w) <= nameplate_w

    def implausible(self, now_s: float, within_s: float) -> bool:
        """Whether it sent implausible telemetry within the last ``within_s``."""
        return self.implausible_s is not None and now_s - self.implausible_s <= within_s

    def health(self, now_s: float, stale_after_s: float) -> NodeHealth:
        """fresh, stale, offline or unknown at ``now_s``."""
        if self.status == "offline":
            return "offline"
        if self.telemetry is None or self.received_s is None:
            return "unknown"
        if now_s - self.received_s > stale_after_s:
            return "stale"
        return "fresh"

    def power_w(self, health: NodeHealth) -> float:
        """The node's power as counted in its health state."""
        if health != "fresh" or self.telemetry is None:
            return self.nameplate_w()
        return self._node_w(self.gpu_power_w)

    def learn(self, gpus: tuple[GpuTelemetry, ...], bounds: IntakeSettings) -> None:
        """Fix the GPU count and per-GPU bound from the topology or the first report.

        The per-GPU bound: the topology's ``gpu_max_power_w``; else, for a product in the
        table of published limits (``polca.gpu.products``), the smaller of that limit and
        the largest maximum the node declares, never above the product's whatever it
        declares; else the node's declared maximum cut to ``intake.max_gpu_power_w``
        (``bound_source`` says which, so the intake can say when it trusted the node)."""
        count = self.spec.gpus or min(len(gpus), bounds.max_gpus_per_node)
        if count == 0:
            return  # nothing to learn from a report without GPUs: the next one
        per_gpu_w = self.spec.gpu_max_power_w
        source: BoundSource = "topology"
        if per_gpu_w is None:
            reported = [g.power_limit_max_w for g in gpus if g.power_limit_max_w is not None]
            declared_w = max(reported, default=bounds.max_gpu_power_w)
            products = [published_max_power_w(g.name) for g in gpus[:count]]
            known = [w for w in products if w is not None]
            if known and len(known) == len(products):
                per_gpu_w, source = min(declared_w, max(known)), "product"
            else:
                per_gpu_w = min(declared_w, bounds.max_gpu_power_w)
                source = "declared" if reported else "intake"
        self.bound_source = source
        self.gpu_count = count
        self.gpu_bound_w = count * per_gpu_w * (1 + bounds.power_headroom_fraction)

    def admit_gpus(
        self, gpus: tuple[GpuTelemetry, ...]
    ) -> tuple[tuple[GpuTelemetry, ...], list[Anomaly]]:
        """The GPUs of one report the node can have, and what was cut (and why).

        At most ``gpu_count`` GPUs, each index once, and identities (index, UUID) beyond
        ``IDENTITIES_PER_GPU`` per GPU refused: a node may not grow its GPU list, nor
        invent GPUs to create series.
        """
        count = self.gpu_count or 0
        known = self.identities
        kept: list[GpuTelemetry] = []
        indices: set[int] = set()
        anomalies: list[Anomaly] = []
        for g in gpus:
            key = (g.index, g.uuid)
            if len(kept) >= count:
                anomalies.append("gpu_list")
                break
            if g.index in indices or (
                key not in known and len(known) >= count * IDENTITIES_PER_GPU
            ):
                if "gpu_identity" not in anomalies:
                    anomalies.append("gpu_identity")
                continue
            known.add(key)
            indices.add(g.index)
            kept.append(g)
        return tuple(kept), anomalies


def _sums(
    gpus: tuple[GpuTelemetry, ...], identities: set[tuple[int, str]]
) -> tuple[float, float, bool, bool]:
    """One pass over a report's GPUs (the intake's hot path): their power, their limits,
    whether any has a limit, and whether every GPU is a known identity listed once."""
    gpus_w = 0.0
    limits_w = 0.0
    limited = False
    known = True
    indices = 0  # a bit per index seen
    for g in gpus:
        gpus_w += g.power_mean_w or g.power_w or 0.0
        limit = g.enforced_power_limit_w or g.power_limit_w
        if limit is not None:
            limits_w += limit
            limited = True
        bit = 1 << g.index
        if indices & bit or (g.index, g.uuid) not in identities:
            known = False
        indices |= bit
    return gpus_w, limits_w, limited, known


@dataclass(frozen=True, slots=True)
class RackRollup:
    """One rack at one instant."""

    rack: str
    power_w: float
    budget_w: float | None
    nodes_online: int
    nodes_stale: int
    nodes_offline: int
    gpu_temp_max_c: float | None


@dataclass(frozen=True, slots=True)
class RowRollup:
    """One row at one instant."""

    row: str
    computed_power_w: float
    measured_power_w: float | None
    power_w: float
    power_source: Literal["computed", "meter"]
    budget_w: float
    racks: tuple[RackRollup, ...]
    fresh_nodes: tuple[str, ...]
    stale_nodes: tuple[str, ...]
    offline_nodes: tuple[str, ...]  # offline or never heard from
    implausible_nodes: tuple[str, ...]  # implausible telemetry within stale_after_s
    gpu_temp_max_c: float | None
    energy_j: float  # GPU energy reported since the aggregator started
    meter: MeterJudgement | None = None  # a fresh whole meter reading, as judged
    meter_partial: str | None = None  # a fresh partial meter reading, not used: why
    meter_changes: tuple[TrustChange, ...] = ()  # the meter's standing changed this step
    meter_trusted: bool | None = None  # None: no meter reading ever came
    meter_refusals: int = 0  # meter readings refused since start, every reason

    @property
    def power_note(self) -> str:
        """Why the row does not run on its meter's reading alone ('' when it does, or has
        no fresh reading)."""
        if self.meter_partial is not None:
            return f"meter reading partial ({self.meter_partial})"
        return self.meter.note() if self.meter is not None else ""

    @property
    def all_reported(self) -> bool:
        """Every node of the row has sent fresh telemetry."""
        return not self.stale_nodes and not self.offline_nodes


@dataclass(slots=True)
class RowTracker:
    """The live state of one row, fed by the intake."""

    spec: RowSpec
    bounds: IntakeSettings = field(default_factory=IntakeSettings)
    """What a node can draw when its topology does not say (``learn``)."""
    nodes: dict[str, NodeView] = field(default_factory=dict)
    witness: MeterWitness = field(default_factory=MeterWitness)
    """Whether the meter is believed (its settings: ``ControlSettings.witness``)."""
    meter_w: float | None = None
    meter_received_s: float | None = None
    meter_missing: str | None = None  # the last reading was partial: its failed sources
    meter_partial: int = 0  # partial meter readings received, never used as row power
    energy_j: float = 0.0
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=4096))
    escalate_at_w: float = math.inf  # the next threshold above the row's level (``arm``)
    estimate_w: float = 0.0  # the computed row power, kept current between steps
    _armed: bool = False

    def __post_init__(self) -> None:
        for rack, node in self.spec.nodes():
            self.nodes[node.name] = NodeView(node, rack.name)

    def rack_of(self, node: str) -> str | None:
        """The rack a node belongs to, or None when it is not in this row."""
        view = self.nodes.get(node)
        return view.rack if view is not None else None

    def arm(self, escalate_at_w: float) -> None:
        """Watch for the row power reaching ``escalate_at_w`` before the next step.

        The control step arms the tracker with the threshold above the level it decided;
        the first telemetry or meter reading that takes the row's power there makes
        ``ingest_telemetry`` or ``ingest_meter`` return True, once until the next arming,
        so the caller can run the next step at once instead of at the interval.
        """
        self.escalate_at_w = escalate_at_w
        self._armed = True

    def _crossed(self, power_w: float) -> bool:
        if self._armed and power_w >= self.escalate_at_w:
            self._armed = False
            return True
        return False

    def ingest_telemetry(self, node: str, telemetry: Telemetry, now_s: float) -> Ingested:
        """Record one telemetry message of a node of this row, held to what it can draw."""
        view = self.nodes[node]
        if view.gpu_count is None:
            view.learn(telemetry.gpus, self.bounds)
        anomalies: list[Anomaly] = []
        gpus_w, limits_w, limited, known = _sums(telemetry.gpus, view.identities)
        if not known or len(telemetry.gpus) > (view.gpu_count or 0):
            # Not the GPUs it always reports: cut what it cannot have, and count again.
            gpus, anomalies = view.admit_gpus(telemetry.gpus)
            if anomalies:
                telemetry = telemetry.model_copy(update={"gpus": gpus})
            gpus_w, limits_w, limited, _ = _sums(gpus, view.identities)
        view.telemetry = telemetry
        view.received_s = now_s
        view.status = "online"
        claimed_w = max(telemetry.node_gpu_power_w, gpus_w)
        if view.plausible(claimed_w):
            view.plausible_gpu_w = claimed_w
        else:
            anomalies.append("power")
        view.gpu_power_w = claimed_w  # counted within the bound (NodeView._node_w)
        if limited:
            view.limits_w = limits_w
        if anomalies:
            view.implausible_s = now_s
            view.implausible_readings += 1
        # Energy is held to the same bound over the interval the node claims (at most an
        # hour; the intake admits a few messages per second).
        bound_j = view.gpu_ceiling_w() * telemetry.interval_s
        self.energy_j += min(telemetry.node_energy_delta_j, bound_j)
        counted_w = view.power_w("fresh")
        self.estimate_w += counted_w - view.counted_w
        view.counted_w = counted_w
        return Ingested(telemetry, self._crossed(self.estimate_w), tuple(anomalies))

    def ingest_status(self, node: str, status: Status) -> None:
        """Record a node's online/offline status (its Last Will says offline)."""
        self.nodes[node].status = status.state

    def ingest_meter(self, meter: Meter, now_s: float) -> bool:
        """Record a meter reading of the whole row; True: it crossed (``arm``).

        A partial reading (a source failed) is not the row's power: it replaces the last
        reading with none, so the row falls back to its computed power at once, and
        ``meter_missing`` says why until a whole reading comes.
        """
        self.meter_received_s = now_s
        if meter.partial:
            self.meter_w = None
            self.meter_partial += 1
            self.meter_missing = ", ".join(f"{k}: {v}" for k, v in sorted(meter.missing.items()))
            return False
        self.meter_w = meter.power_w
        self.meter_missing = None
        self.witness.reading(meter.power_w, computed_w=self.estimate_w)
        return self._crossed(meter.power_w)

    def ceiling_w(self) -> float:
        """The most the row can draw: ``meter_max_w``, else its nodes' maxima summed."""
        if self.spec.meter_max_w is not None:
            return self.spec.meter_max_w
        return sum(view.max_w(self.bounds) for view in self.nodes.values())

    def rollup(self, now_s: float, *, stale_after_s: float) -> RowRollup:
        """The row now; also appends the row power to the trend history."""
        racks: dict[str, list[tuple[NodeView, NodeHealth]]] = {r.name: [] for r in self.spec.racks}
        for view in self.nodes.values():
            health = view.health(now_s, stale_after_s)
            view.counted_w = view.power_w(health)
            racks[view.rack].append((view, health))
        rack_rollups = []
        fresh: list[str] = []
        stale: list[str] = []
        offline: list[str] = []
        temps: list[float] = []
        for rack in self.spec.racks:
            members = racks[rack.name]
            rack_temps = [
                g.gpu_temp_max_c or g.gpu_temp_c or 0.0
                for view, health in members
                if health == "fresh" and view.telemetry is not None
                for g in view.telemetry.gpus
                if (g.gpu_temp_max_c or g.gpu_temp_c) is not None
            ]
            temps.extend(rack_temps)
            for view, health in members:
                {"fresh": fresh, "stale": stale}.get(health, offline).append(view.spec.name)
            rack_rollups.append(
                RackRollup(
                    rack=rack.name,
                    power_w=sum(view.power_w(health) for view, health in members),
                    budget_w=rack.budget_w,
                    nodes_online=sum(1 for _, h in members if h == "fresh"),
                    nodes_stale=sum(1 for _, h in members if h == "stale"),
                    nodes_offline=sum(1 for _, h in members if h in ("offline", "unknown")),
                    gpu_temp_max_c=max(rack_temps) if rack_temps else None,
                )
            )
        computed = sum(r.power_w for r in rack_rollups)
        self.estimate_w = computed
        measured = None
        judgement: MeterJudgement | None = None
        changes: list[TrustChange] = []
        power = computed
        if (
            self.meter_w is not None
            and self.meter_received_s is not None
            and now_s - self.meter_received_s <= self.spec.meter_max_age_s
        ):
            reported_w = sum(
                view.power_w(health)
                for members in racks.values()
                for view, health in members
                if health == "fresh"
            )
            judgement, changes = self.witness.judge(
                self.meter_w,
                now_s=now_s,
                reported_w=reported_w,
                ceiling_w=self.ceiling_w(),
                computed_w=computed,
            )
            if judgement.verdict == "used":
                measured = power = self.meter_w
            elif judgement.verdict == "held":
                measured = self.meter_w
                power = max(computed, self.meter_w)
        self.history.append((now_s, power))
        return RowRollup(
            row=self.spec.name,
            computed_power_w=computed,
            measured_power_w=measured,
            power_w=power,
            power_source="meter" if measured is not None and power == measured else "computed",
            budget_w=self.spec.budget_w,
            racks=tuple(rack_rollups),
            fresh_nodes=tuple(sorted(fresh)),
            stale_nodes=tuple(sorted(stale)),
            offline_nodes=tuple(sorted(offline)),
            implausible_nodes=tuple(
                sorted(n for n, v in self.nodes.items() if v.implausible(now_s, stale_after_s))
            ),
            gpu_temp_max_c=max(temps) if temps else None,
            energy_j=self.energy_j,
            meter=judgement,
            meter_changes=tuple(changes),
            meter_trusted=self.witness.trusted if self.meter_received_s is not None else None,
            meter_refusals=self.witness.refusals.total(),
            meter_partial=(
                self.meter_missing
                if self.meter_received_s is not None
                and now_s - self.meter_received_s <= self.spec.meter_max_age_s
                else None
            ),
        )

    def trend_w_per_s(self, now_s: float, window_s: float) -> float | None:
        """Least-squares slope of row power over the last ``window_s``; None if too few."""
        return trend.trend_w_per_s(self.history, now_s, window_s=window_s)
