"""The aggregator's settings: the site's power topology, control timing, and the sinks.

Topology: one site, the rows (power domains) this aggregator owns, each with a provisioned
budget, an optional meter topic, and its racks and nodes. Several aggregators may share a
broker, each owning different rows. Every node carries an estimate of its non-GPU power
(``non_gpu_w`` plus ``non_gpu_factor`` times its GPU power) for rows without a meter, and
optionally a nameplate used when the node is stale or offline (see ``rollup.py``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Final, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polca.aggregator.witness import WitnessSettings
from polca.bmc.config import BmcSettings
from polca.cooling.loops import CoolingSettings
from polca.coord.config import HaSettings
from polca.powertree.model import Feed
from polca.settings import (
    DEFAULT_TOPIC_ROOT,
    TOPIC_SEGMENT,
    DarkPollsDown,
    InfluxSettings,
    ProcessSettings,
    SiteName,
    TopicRoot,
)
from polca.telemetry.schema import MAX_PAYLOAD_BYTES, MAX_ROW_NODES, MAX_ROW_RACKS
from polca.telemetry.topics import RESERVED_ROW_NAMES

MAX_BUDGET_W = 1e9
"""A row's or rack's budget: 1 GW, beyond any real power domain. With the node bounds
below, a row's summed power stays far inside what its summary carries (``MAX_TOTAL_W``)."""
MAX_DECLARED_NODE_W = 1e6
"""A node's declared nameplate or non-GPU power."""
MAX_GPU_W = 1e4
"""One GPU's declared or assumed maximum power."""

_NAME = TOPIC_SEGMENT


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSpec(_Model):
    """One GPU node."""

    name: str = Field(pattern=_NAME, description="Node name, as in the agent's topics.node.")
    non_gpu_w: float = Field(
        0.0,
        ge=0,
        le=MAX_DECLARED_NODE_W,
        description="Non-GPU power (CPUs, fans, NICs) added to the GPUs' power.",
    )
    non_gpu_factor: float = Field(
        0.0, ge=0, le=2, description="Extra non-GPU power as a fraction of the GPU power."
    )
    nameplate_w: float | None = Field(
        None,
        gt=0,
        le=MAX_DECLARED_NODE_W,
        description="Worst-case node power: counted while the node is stale or offline, and "
        "the most any of its readings is counted at (a higher claim is implausible); "
        "default: the GPUs' enforced limits from its last telemetry plus non-GPU power "
        "while stale or offline, and the plausible bound (docs/intake.md) for readings.",
    )
    gpus: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="GPUs on this node; default: as many as its first telemetry lists (at "
        "most intake.max_gpus_per_node). A node may not report more.",
    )
    gpu_max_power_w: float | None = Field(
        None,
        gt=0,
        le=MAX_GPU_W,
        description="The most one GPU of this node can draw (its maximum power limit); "
        "default: the largest maximum limit its first telemetry reports, at most "
        "intake.max_gpu_power_w.",
    )


class RackSpec(_Model):
    """One rack of a row."""

    name: str = Field(pattern=_NAME)
    budget_w: float | None = Field(
        None, gt=0, le=MAX_BUDGET_W, description="Rack electrical budget, if any."
    )
    nodes: tuple[NodeSpec, ...] = Field(min_length=1, max_length=MAX_ROW_NODES)


class RowFeedSpec(_Model):
    """One feed of a row (path A or B): its rating and the meter sources that measure it."""

    name: str = Field(pattern=_NAME, description="The feed's name (A, B).")
    rating_w: float = Field(
        gt=0, le=MAX_BUDGET_W, description="What this feed alone can carry to the row."
    )
    sources: tuple[Annotated[str, Field(pattern=_NAME)], ...] = Field(
        min_length=1,
        max_length=64,
        description="The row meter's sources on this feed (names in its meter reading).",
    )
    loss_means_down: bool = Field(
        True,
        description="The sources are powered by this feed: all of them unreachable for "
        "site_budget.dark_polls_down readings means the feed is down.",
    )

    def feed(self) -> Feed:
        """The power tree's view of this feed."""
        return Feed(self.name, self.rating_w, self.sources, self.loss_means_down)


class RowSpec(_Model):
    """One row: a power domain with a provisioned budget."""

    name: str = Field(pattern=_NAME)
    budget_w: float = Field(gt=0, le=MAX_BUDGET_W, description="Provisioned row power budget.")
    meter_topic: str | None = Field(
        None, description="MQTT topic where a PDU or meter publishes the row's power."
    )
    meter_max_age_s: float = Field(
        5.0, gt=0, le=3600, description="A meter reading older than this is ignored."
    )
    meter_max_w: float | None = Field(
        None,
        gt=0,
        le=MAX_BUDGET_W,
        description="The most the row's meter may read: above it a reading is implausible "
        "and not used; default: the sum of the row's nodes' plausible maxima (their "
        "nameplate_w, else their GPUs' bound) with their non-GPU power.",
    )
    fallback_budget_w: float | None = Field(
        None,
        gt=0,
        le=MAX_BUDGET_W,
        description="The row takes leased budgets from the site controller, and runs on "
        "this one while it holds none (the lease lapsed, or none came yet): for a row "
        "budgeted over one feed's rating, that feed's rating. Unset: no site budgets.",
    )
    floor_w: float | None = Field(
        None,
        ge=0,
        le=MAX_BUDGET_W,
        description="What the row's nodes draw at the fail-safe caps, which the site "
        "controller never allocates below; default: the sum of its nodes' non-GPU power "
        "and their GPUs' fail-safe power limits (their power now where a class has none).",
    )
    feeds: tuple[RowFeedSpec, ...] = Field(
        (),
        max_length=16,
        description="The row's feeds (A, B) and the meter sources on each: when one goes "
        "down the row runs at once on what the others carry (empty: not watched).",
    )
    racks: tuple[RackSpec, ...] = Field(min_length=1, max_length=MAX_ROW_RACKS)

    def nodes(self) -> list[tuple[RackSpec, NodeSpec]]:
        """Every node of the row with its rack."""
        return [(rack, node) for rack in self.racks for node in rack.nodes]

    @model_validator(mode="after")
    def _bounded(self) -> Self:
        count = sum(len(rack.nodes) for rack in self.racks)
        if count > MAX_ROW_NODES:
            msg = (
                f"row {self.name} has {count} nodes; at most {MAX_ROW_NODES} fit one row's "
                "summary: split it into rows"
            )
            raise ValueError(msg)
        if self.fallback_budget_w is not None and self.fallback_budget_w > self.budget_w:
            msg = (
                f"row {self.name}: fallback_budget_w ({self.fallback_budget_w:g}) is above "
                f"budget_w ({self.budget_w:g}): a row never runs above its own budget"
            )
            raise ValueError(msg)
        feeds = [feed.name for feed in self.feeds]
        if len(feeds) != len(set(feeds)):
            msg = f"row {self.name}: feed names must be unique, got {feeds}"
            raise ValueError(msg)
        return self


class SiteBudgetSettings(_Model):
    """Leased row budgets from the site controller (``polca site``), docs/power-tree.md."""

    issuers: tuple[Annotated[str, Field(pattern=_NAME)], ...] = Field(
        (),
        max_length=16,
        description="The site controllers whose budgets the rows take (their instance "
        "names); empty: any issuer the broker lets publish the budget topic.",
    )
    max_lease_s: float = Field(
        60.0, gt=0, le=3600, description="The longest lease one budget message grants."
    )
    dark_polls_down: DarkPollsDown = 3


SINGLE_BROKER_LEASE_S: Final = 10.0
"""The control lease on one broker (``control.lease_s`` unset)."""
CLUSTER_LEASE_S: Final = 30.0
"""The control lease on a broker cluster (several ``mqtt.endpoints``, ``control.lease_s``
unset): longer than a failover's 5 to 12 s wait for the cluster's elections, twice over."""


class ControlSettings(_Model):
    """The row controller's timing and mode."""

    interval_s: float = Field(1.0, gt=0, le=60, description="How often each row is evaluated.")
    lease_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="Lease granted by each control message (renewed each interval). "
        "Default: 10 s with one broker, 30 s with several mqtt.endpoints (a cluster: a "
        "client that moves after a broker node is lost waits while the cluster elects new "
        "leaders, 5 to 12 s measured, docs/mqtt.md). Agents cut it to their policy's "
        "fail_safe.max_lease_s (30 s by default).",
    )
    stale_after_s: float = Field(
        5.0, gt=0, le=86_400, description="A node without telemetry for this long counts as stale."
    )
    warmup_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="After start, wait this long (or until every node reported) before "
        "publishing control, so a restart never uncaps on missing data.",
    )
    trend_window_s: float = Field(
        10.0, gt=0, le=3600, description="Window of the row power trend (least-squares slope)."
    )
    observe: bool = Field(
        False, description="Shadow mode: publish decisions marked observe; agents do not apply."
    )
    publish_policy: bool = Field(
        True, description="Publish the node policy (retained) for agents to apply."
    )
    clock_skew_tolerance_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="How far a node's, meter's or CDU's wall-clock stamps may differ from "
        "this clock: beyond it, the stamp is not trusted (counted as clock_skew; points are "
        "stamped on receipt) and a retained reading of unknown age is dropped.",
    )
    meter_min_fraction: float = Field(
        0.9,
        ge=0,
        le=1,
        description="A meter reading below this fraction of the whole-node power the row's "
        "fresh nodes report (their GPU power plus their non_gpu_w and non_gpu_factor) is "
        "under-reading (a meter cannot read less than what it feeds): the computed row "
        "power is used instead, and the reading is counted. 1 minus this is the tolerance "
        "for the nodes' non-GPU estimate and the meter's accuracy.",
    )
    meter_hold_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="After a refused meter reading, the meter's readings only raise the row "
        "power above its computed power (never lower it) for this long, so the choice "
        "does not flap from one reading to the next.",
    )
    meter_frozen_readings: int = Field(
        10,
        ge=2,
        le=100_000,
        description="A meter reading repeated exactly this many times in a row while the "
        "row's computed power moved by more than meter_frozen_change_fraction is frozen "
        "(a hung PDU card answers its last value): not used until its value moves.",
    )
    meter_frozen_change_fraction: float = Field(
        0.05,
        gt=0,
        le=1,
        description="How far, as a fraction, the row's computed power must move while a "
        "meter repeats one value for the meter to be frozen.",
    )

    def witness(self) -> WitnessSettings:
        """How far each row's meter is believed (``polca.aggregator.witness``)."""
        return WitnessSettings(
            min_fraction=self.meter_min_fraction,
            hold_s=self.meter_hold_s,
            frozen_readings=self.meter_frozen_readings,
            frozen_change_fraction=self.meter_frozen_change_fraction,
        )

    crash_loop_after: int = Field(
        3,
        ge=2,
        description="Report a crash loop (log, systemd STATUS=, MQTT status) when the "
        "aggregator ended this many times in a row with the same failure.",
    )


class IntakeSettings(_Model):
    """What one node may claim and send: plausibility bounds and per-source admission.

    A node's counted power is bounded by what it can draw (docs/intake.md); each node's
    messages are admitted by token buckets before they are decoded, so one node (a firmware
    bug, stolen credentials) cannot starve the others or the control step. Rates are per
    node (per meter or CDU topic for those); the burst is how many may arrive at once
    after a quiet spell.
    """

    max_gpus_per_node: int = Field(
        8,
        ge=1,
        le=1024,
        description="The most GPUs a node may list when the topology does not declare "
        "its gpus (an HGX or MI300 board has 8): its first telemetry's count, cut to this.",
    )
    max_gpu_power_w: float = Field(
        1400.0,
        gt=0,
        le=MAX_GPU_W,
        description="The most one GPU may draw when the topology does not declare "
        "gpu_max_power_w (the highest maximum power limit of current data-center GPUs): "
        "the plausible bound per GPU is the smaller of this and the maximum limit the "
        "node's first telemetry reports.",
    )
    power_headroom_fraction: float = Field(
        0.25,
        ge=0,
        le=1,
        description="A GPU's mean power may exceed its maximum limit by this fraction "
        "(prompt spikes reach 1.16 x TDP) before the reading is implausible.",
    )
    telemetry_per_s: float = Field(
        4.0,
        gt=0,
        le=10_000,
        description="Telemetry messages per second admitted from one node (an agent sends "
        "one per publish interval, 1 s by default); excess is dropped as rate_limited.",
    )
    telemetry_burst: int = Field(
        8, ge=1, le=100_000, description="Telemetry messages one node may send at once."
    )
    messages_per_s: float = Field(
        20.0,
        gt=0,
        le=10_000,
        description="Status, state and event messages per second admitted from one node "
        "(a bucket apart from telemetry's, so a flood of events does not silence a "
        "node's power readings).",
    )
    messages_burst: int = Field(
        100, ge=1, le=100_000, description="Status, state and event messages at once."
    )
    bytes_per_s: float = Field(
        256 * 1024.0,
        gt=0,
        description="Payload bytes per second admitted from one node, every channel together "
        "(an 8-GPU telemetry is about 6 KB).",
    )
    bytes_burst: int = Field(
        1024 * 1024,
        ge=MAX_PAYLOAD_BYTES,
        description="Payload bytes one node may send at once (at least the largest "
        "message the wire allows).",
    )
    source_per_s: float = Field(
        20.0,
        gt=0,
        le=10_000,
        description="Messages per second admitted on each meter and CDU topic.",
    )
    source_burst: int = Field(40, ge=1, le=100_000, description="Meter or CDU messages at once.")
    connections: int = Field(
        4,
        ge=1,
        le=64,
        description="MQTT connections the nodes' topics are spread over (each node on one, "
        "by a hash of its name), beside the connection that carries control, meters and "
        "CDUs: the broker queues messages per connection, so a node flooding it fills "
        "its own connection's queue and the nodes on the others stay fresh.",
    )
    quarantine_after: int = Field(
        100,
        ge=1,
        description="A node whose messages the admission refused this many times is moved "
        "to a connection of its own: its flood then fills that connection's queue at the "
        "broker, not the one it shared with other nodes.",
    )
    quarantine_release_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="A quarantined node whose messages the admission has refused none of "
        "for this long is moved back to its shared connection (on its next admitted "
        "message; node_released event), and counts towards quarantine_after afresh.",
    )
    warn_every_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="At most one warning of each kind per node per this many seconds "
        "(node offline, implausible telemetry); every occurrence is counted. Drops, "
        "rate-limited messages included, are logged once per 10 s per reason.",
    )


class AggregatorSettings(ProcessSettings):
    """All settings of the aggregator."""

    site: SiteName = "site"
    instance: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0] or "aggregator",
        pattern=_NAME,
        description="This aggregator's name (client id, status topic).",
    )
    topic_root: TopicRoot = DEFAULT_TOPIC_ROOT
    policy_file: Path = Field(
        Path("/etc/polca/policy.yaml"), description="The policy (source of the node policy)."
    )
    state_dir: Path = Field(
        default_factory=lambda: Path(
            os.environ.get("STATE_DIRECTORY", "/var/lib/polca-aggregator")
        ),
        description="Where the InfluxDB spool lives by default ($STATE_DIRECTORY).",
    )
    rows: tuple[RowSpec, ...] = Field((), description="The rows this aggregator owns.")
    control: ControlSettings = Field(default_factory=ControlSettings)
    intake: IntakeSettings = Field(
        default_factory=IntakeSettings,
        description="Plausibility bounds of each node's readings and per-node admission.",
    )
    influx: InfluxSettings = Field(default_factory=InfluxSettings)
    cooling: CoolingSettings = Field(
        default_factory=CoolingSettings,
        description="Liquid-cooling loops (one per CDU) and the racks each serves.",
    )
    ha: HaSettings = Field(
        default_factory=HaSettings,
        description="High availability: a leader per shard elected on etcd.",
    )
    site_budget: SiteBudgetSettings = Field(
        default_factory=SiteBudgetSettings,
        description="Leased row budgets from the site controller, and the rows' feeds.",
    )
    bmc: BmcSettings = Field(
        default_factory=BmcSettings,
        description="Out-of-band caps through the nodes' BMCs (Redfish), for nodes whose "
        "agent cannot cap them.",
    )

    @property
    def lease_s(self) -> float:
        """``control.lease_s``, or its default: 10 s on one broker, 30 s on a cluster."""
        if self.control.lease_s is not None:
            return self.control.lease_s
        return CLUSTER_LEASE_S if self.mqtt.clustered else SINGLE_BROKER_LEASE_S

    @property
    def shard(self) -> str:
        """The election's shard name (``ha.shard``, or the owned rows joined by '+')."""
        return self.ha.shard or "+".join(row.name for row in self.rows) or "none"

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        rows = [row.name for row in self.rows]
        reserved = sorted(set(rows) & RESERVED_ROW_NAMES)
        if reserved:
            msg = (
                f"row names {reserved} are reserved: topics {{root}}/{{site}}/cooling/..., "
                "{root}/{site}/aggregator/... and {root}/{site}/powertree/... would collide "
                "with the row's (and the broker ACLs could not tell them apart); rename the row"
            )
            raise ValueError(msg)
        if len(rows) != len(set(rows)):
            msg = f"row names must be unique, got {rows}"
            raise ValueError(msg)
        seen: dict[str, str] = {}
        for row in self.rows:
            racks = [rack.name for rack in row.racks]
            if len(racks) != len(set(racks)):
                msg = f"rack names must be unique within row {row.name}, got {racks}"
                raise ValueError(msg)
            for rack, node in row.nodes():
                where = f"{row.name}/{rack.name}"
                if node.name in seen:
                    msg = f"node {node.name} appears twice: in {seen[node.name]} and {where}"
                    raise ValueError(msg)
                seen[node.name] = where
        self.cooling.check_racks({row.name: [rack.name for rack in row.racks] for row in self.rows})
        unknown = sorted(set(self.bmc.nodes) - set(seen))
        if unknown:
            msg = f"bmc.nodes {unknown[:8]} are not nodes of the rows: check their names"
            raise ValueError(msg)
        if self.ha.enabled and self.ha.lease_ttl_s * 2 > self.lease_s:
            msg = (
                f"ha.lease_ttl_s ({self.ha.lease_ttl_s:g} s) must be at most half of "
                f"control.lease_s ({self.lease_s:g} s): a standby must lead before "
                "the agents' leases end"
            )
            raise ValueError(msg)
        return self
