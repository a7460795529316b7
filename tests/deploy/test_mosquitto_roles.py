"""Every role against a real Mosquitto: what each user may write and read, with both ACLs.

Each ACL gets a universe of topics, built with polca's own ``Topics`` (so a change of
topic layout shows here): every topic a role uses, the neighbouring topics it must not
touch (another node, rack, row, site, CDU, instance), and the collisions the ACLs guard
against. Every user publishes every topic of the universe, and every user subscribes to
``#`` while a test writer publishes every topic (retained, then live); the tests compare
what got through with the role matrix below, user by user (``mosquitto_rig``).

The pattern ACL's matrix also records what a pattern cannot confine (marked "limitation"):
those entries are the documented trade-off, and the strict ACL's matrix shows each of them
closed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiomqtt
import pytest
import yaml

from polca.aggregator.config import AggregatorSettings
from polca.aggregator.intake import Intake
from polca.aggregator.step import RowControl
from polca.powertree.sitefile import load_site
from polca.sitectl.config import SiteSettings
from polca.sitectl.core import SiteCore
from polca.telemetry.topics import NODE_CHANNELS, NodeAddress, NodeChannel, Topics
from tests.deploy import mosquitto_rig as rig
from tests.mqtt_broker import MosquittoProcess

TOPICS = Topics()
SITE = "dc1"
SITE_EXAMPLE = rig.ROOT / "deploy" / "site" / "site.example.yaml"
SERVICES = (
    "polca-aggregator",
    "polca-scheduler",
    "polca-viewer",
    "meter",
    "polca-cdu-sim",
    "polca-site",
    "polca-operator",
)
"""The service users of the pattern ACL."""

Matrix = dict[str, list[str]]


def node(row: str, rack: str, name: str, channel: NodeChannel, *, site: str = SITE) -> str:
    """A node channel's topic."""
    return TOPICS.node(NodeAddress(site, row, rack, name), channel)


def channels(row: str, rack: str, name: str, *which: NodeChannel) -> list[str]:
    """Several channels of one node (all five by default)."""
    chosen = which or NODE_CHANNELS
    return [node(row, rack, name, channel) for channel in chosen]


PUBLISHED: tuple[NodeChannel, ...] = ("telemetry", "status", "state", "events")
"""The channels a node agent writes."""


def matrix(**entries: Sequence[str]) -> Matrix:
    """user -> sorted topics; keyword names use ``_`` for ``-`` (polca_viewer)."""
    return {user.replace("_", "-"): sorted(topics) for user, topics in entries.items()}


@pytest.fixture
def deployed_broker(tmp_path: Path) -> Iterator[rig.BrokerFactory]:
    """Start brokers with the deploy configuration; all are killed after the test."""
    with rig.brokers(tmp_path) as start:
        yield start


# --- The pattern ACL -----------------------------------------------------------------

# node1 and node2 in row1/rack1; loop1 is a node (in row2/rack9) named like a cooling loop.
P_NODES = ("node1", "node2", "loop1")
P_CDUS = ("cdu1", "cdu2")

P_UNIVERSE = sorted(
    {
        *channels("row1", "rack1", "node1"),
        *channels("row1", "rack1", "node2"),
        # node1 outside its rack, row and site; a node in a row named "cooling".
        node("row2", "rack9", "node1", "telemetry"),
        node("row2", "rack9", "node1", "assign"),
        node("row1", "rack1", "node1", "telemetry", site="dc2"),
        node("cooling", "rack1", "node1", "telemetry"),
        # The node named like a loop, and the loop's own state and alarms.
        node("row2", "rack9", "loop1", "state"),
        TOPICS.loop_state(SITE, "loop1"),
        TOPICS.loop_alarms(SITE, "loop1"),
        # Users posing as a node or a CDU of their own name.
        *(node("row1", "rack1", user, ch) for user in SERVICES for ch in ("telemetry", "assign")),
        *(TOPICS.cdu(SITE, user) for user in (*SERVICES, "node1")),
        node("row1", "rack1", "cdu1", "telemetry"),
        # Rows, racks, meters, CDUs, the aggregator.
        TOPICS.row_control(SITE, "row1"),
        TOPICS.row_control(SITE, "row2"),
        TOPICS.rack_control(SITE, "row1", "rack1"),
        TOPICS.rack_control(SITE, "row2", "rack9"),
        TOPICS.policy(SITE, "row1"),
        TOPICS.policy(SITE, "row2"),
        TOPICS.row_summary(SITE, "row1"),
        TOPICS.meter(SITE, "row1"),
        TOPICS.meter(SITE, "row2"),
        TOPICS.cdu(SITE, "cdu1"),
        TOPICS.cdu(SITE, "cdu2"),
        TOPICS.aggregator(SITE, "agg1", "status"),
        TOPICS.aggregator(SITE, "agg1", "events"),
        # The power tree: budgets, the site report, limits (one on a domain named like the
        # rack-control channel), here and in another site.
        *(TOPICS.budget(SITE, row) for row in ("row1", "row2")),
        TOPICS.budget("dc2", "row1"),
        TOPICS.site_report(SITE),
        TOPICS.site_report("dc2"),
        TOPICS.budget_limit(SITE, "ups-a"),
        TOPICS.budget_limit(SITE, "control"),
        TOPICS.budget_limit("dc2", "ups-a"),
        "elsewhere/node1/telemetry",
    }
)

P_BUDGETS = [TOPICS.budget(SITE, "row1"), TOPICS.budget(SITE, "row2"), TOPICS.budget("dc2", "row1")]
P_LIMITS = [TOPICS.budget_limit(SITE, "ups-a"), TOPICS.budget_limit("dc2", "ups-a")]
"""The limits the site controller and the operator can use: not the one on a domain named
``control`` (limitation: their rack-control denies take it)."""
P_SITE_REPORTS = [TOPICS.site_report(SITE), TOPICS.site_report("dc2")]

P_CONTROL_AND_POLICY = [
    TOPICS.row_control(SITE, "row1"),
    TOPICS.row_control(SITE, "row2"),
    TOPICS.rack_control(SITE, "row1", "rack1"),
    TOPICS.rack_control(SITE, "row2", "rack9"),
    TOPICS.policy(SITE, "row1"),
    TOPICS.policy(SITE, "row2"),
]

P_WRITES = matrix(
    node1=[
        *channels("row1", "rack1", "node1", *PUBLISHED),
        # limitation: its own topics in another row and site, and a CDU of its name.
        node("row2", "rack9", "node1", "telemetry"),
        node("row1", "rack1", "node1", "telemetry", site="dc2"),
        TOPICS.cdu(SITE, "node1"),
    ],
    node2=channels("row1", "rack1", "node2", *PUBLISHED),
    loop1=[node("row2", "rack9", "loop1", "state")],
    # limitation: a node of its name.
    cdu1=[TOPICS.cdu(SITE, "cdu1"), node("row1", "rack1", "cdu1", "telemetry")],
    cdu2=[TOPICS.cdu(SITE, "cdu2")],
    polca_aggregator=[
        *P_CONTROL_AND_POLICY,
        TOPICS.row_summary(SITE, "row1"),
        TOPICS.loop_state(SITE, "loop1"),
        TOPICS.loop_alarms(SITE, "loop1"),
        TOPICS.aggregator(SITE, "agg1", "status"),
        TOPICS.aggregator(SITE, "agg1", "events"),
    ],
    polca_scheduler=[
        node("row1", "rack1", "node1", "assign"),
        node("row1", "rack1", "node2", "assign"),
        node("row2", "rack9", "node1", "assign"),
        *(node("row1", "rack1", user, "assign") for user in SERVICES if user != "polca-scheduler"),
    ],
    polca_viewer=[],
    meter=[TOPICS.meter(SITE, "row1"), TOPICS.meter(SITE, "row2")],
    polca_cdu_sim=[TOPICS.cdu(SITE, cdu) for cdu in (*P_CDUS, *SERVICES, "node1")],
    # Budgets and the site report under any site, as every pattern-ACL service grant.
    polca_site=[*P_BUDGETS, *P_SITE_REPORTS],
    polca_operator=P_LIMITS,
)

P_NODE_TELEMETRY = [
    node("row1", "rack1", "node1", "telemetry"),
    node("row1", "rack1", "node2", "telemetry"),
    node("row2", "rack9", "node1", "telemetry"),
    node("row1", "rack1", "node1", "telemetry", site="dc2"),
    node("cooling", "rack1", "node1", "telemetry"),
    node("row1", "rack1", "cdu1", "telemetry"),
]


def _others(user: str, make: str) -> list[str]:
    """``make`` ('node' or 'cdu') topics of every service user but ``user``."""
    return [
        node("row1", "rack1", other, "telemetry") if make == "node" else TOPICS.cdu(SITE, other)
        for other in SERVICES
        if other != user
    ]


P_READS = matrix(
    # limitation: every row's control and policy; its assignment in any rack.
    node1=[
        *P_CONTROL_AND_POLICY,
        node("row1", "rack1", "node1", "assign"),
        node("row2", "rack9", "node1", "assign"),
    ],
    node2=[*P_CONTROL_AND_POLICY, node("row1", "rack1", "node2", "assign")],
    loop1=P_CONTROL_AND_POLICY,
    # limitation: a CDU user gets the node grants' control and policy.
    cdu1=P_CONTROL_AND_POLICY,
    cdu2=P_CONTROL_AND_POLICY,
    polca_aggregator=[
        *P_NODE_TELEMETRY,
        *_others("polca-aggregator", "node"),
        *channels("row1", "rack1", "node1", "status", "events"),
        *channels("row1", "rack1", "node2", "status", "events"),
        *P_CONTROL_AND_POLICY,  # the policy it wrote, through the node grants
        TOPICS.meter(SITE, "row1"),
        TOPICS.meter(SITE, "row2"),
        *(TOPICS.cdu(SITE, cdu) for cdu in (*P_CDUS, "node1")),
        *_others("polca-aggregator", "cdu"),
        *P_BUDGETS,
    ],
    polca_scheduler=channels("row1", "rack1", "node1", "status")
    + channels("row1", "rack1", "node2", "status")
    # polca assign reads back the assignments it writes (not its own name's: a node deny).
    + [
        node("row1", "rack1", "node1", "assign"),
        node("row1", "rack1", "node2", "assign"),
        node("row2", "rack9", "node1", "assign"),
        *(node("row1", "rack1", user, "assign") for user in SERVICES if user != "polca-scheduler"),
    ],
    polca_viewer=[
        topic
        for topic in P_UNIVERSE
        if topic.startswith("polca/v1/")
        and topic
        not in {
            node("row1", "rack1", "polca-viewer", "telemetry"),
            node("row1", "rack1", "polca-viewer", "assign"),
            TOPICS.cdu(SITE, "polca-viewer"),
        }
    ],
    meter=[],
    polca_cdu_sim=[*P_NODE_TELEMETRY, *_others("polca-cdu-sim", "node")],
    polca_site=[
        TOPICS.meter(SITE, "row1"),
        TOPICS.meter(SITE, "row2"),
        TOPICS.row_summary(SITE, "row1"),
        *P_LIMITS,
    ],
    polca_operator=[*P_LIMITS, *P_SITE_REPORTS, TOPICS.row_summary(SITE, "row1"), *P_BUDGETS],
)


@pytest.fixture
def pattern_roles(
    tmp_path: Path, deployed_broker: rig.BrokerFactory
) -> tuple[MosquittoProcess, dict[str, str]]:
    """The pattern ACL (plus the probes' grants), every role's user, one broker."""
    users = [*SERVICES, *P_NODES, *P_CDUS, *rig.TEST_USERS]
    passwords = rig.make_passwords(tmp_path, users)
    acl = rig.probe_acl(rig.PATTERN_ACL, tmp_path / "acl")
    return deployed_broker(acl=acl, password_file=tmp_path / "passwd"), passwords


def test_the_matrices_name_every_user() -> None:
    """Each matrix covers exactly the users of its ACL, and only topics of its universe."""
    users = {*SERVICES, *P_NODES, *P_CDUS}
    assert set(P_WRITES) == set(P_READS) == users
    for topics in [*P_WRITES.values(), *P_READS.values()]:
        assert set(topics) <= set(P_UNIVERSE)
    assert set(S_WRITES) == set(S_READS) == set(S_USERS)
    for topics in [*S_WRITES.values(), *S_READS.values()]:
        assert set(topics) <= set(S_UNIVERSE)


async def test_pattern_acl_writes_by_role(
    pattern_roles: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """Pattern ACL: each user's publishes that reach a subscriber to # are its role's."""
    broker, passwords = pattern_roles
    got = await rig.observed_writes(broker, passwords, P_UNIVERSE)
    assert rig.differences(got, P_WRITES) == {}


async def test_pattern_acl_reads_by_role(
    pattern_roles: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """Pattern ACL: what each user subscribed to # receives, retained and live."""
    broker, passwords = pattern_roles
    got = await rig.observed_reads(broker, passwords, P_UNIVERSE)
    assert {kind: rig.differences(seen, P_READS) for kind, seen in got.items()} == {
        "retained": {},
        "live": {},
    }


# --- The strict ACL from make-acl.py ---------------------------------------------------

# node1 and node2 share rack1, node3 is in rack2 of the same row, node9 in row2. Row1's
# meter publishes outside polca's root; row2's on the default topic. loop1 (CDU cdu1)
# cools rack1 and rack2, loop2 (cdu2, a `polca cdu simulate`) cools rack9. Both rows take
# the site controller's budgets (fallback_budget_w).
S_TOPOLOGY = """\
site: dc1
instance: agg1
policy_file: /etc/polca/policy.yaml
mqtt:
  username: polca-aggregator
rows:
  - name: row1
    budget_w: 120000
    fallback_budget_w: 100000
    meter_topic: pdu/dc1/row1/power
    racks:
      - name: rack1
        nodes:
          - {name: node1, non_gpu_w: 1200}
          - {name: node2, non_gpu_w: 1200}
      - name: rack2
        nodes:
          - {name: node3, non_gpu_w: 1200}
  - name: row2
    budget_w: 60000
    fallback_budget_w: 50000
    racks:
      - name: rack9
        nodes:
          - {name: node9, non_gpu_w: 1200}
cooling:
  loops:
    - {name: loop1, cdu: cdu1, racks: [rack1, rack2], heat_capacity_kw: 100, design_flow_lpm: 150}
    - {name: loop2, cdu: cdu2, racks: [rack9], heat_capacity_kw: 50, design_flow_lpm: 80}
"""

S_NODES = {"node1": ("row1", "rack1"), "node2": ("row1", "rack1"), "node3": ("row1", "rack2")}
S_NODES["node9"] = ("row2", "rack9")
S_USERS = (
    "polca-aggregator",
    "polca-scheduler",
    "polca-viewer",
    "polca-site",
    "polca-operator",
    "meter-row1",
    "meter-row2",
    "cdu1",
    "cdu2",
    *S_NODES,
)
ROW1_METER = "pdu/dc1/row1/power"

S_UNIVERSE = sorted(
    {
        *(topic for name, (row, rack) in S_NODES.items() for topic in channels(row, rack, name)),
        # node1 outside its rack, row and site.
        node("row1", "rack2", "node1", "telemetry"),
        node("row2", "rack9", "node1", "telemetry"),
        node("row1", "rack1", "node1", "telemetry", site="dc2"),
        # Control of the topology's rows and racks, and of a row and rack outside it.
        *(TOPICS.row_control(SITE, row) for row in ("row1", "row2", "row3")),
        TOPICS.rack_control(SITE, "row1", "rack1"),
        TOPICS.rack_control(SITE, "row1", "rack2"),
        TOPICS.rack_control(SITE, "row2", "rack9"),
        TOPICS.rack_control(SITE, "row1", "rack7"),
        *(TOPICS.policy(SITE, row) for row in ("row1", "row2")),
        *(TOPICS.row_summary(SITE, row) for row in ("row1", "row2")),
        # Row1's meter topic, row1's unused default one, row2's default one.
        ROW1_METER,
        TOPICS.meter(SITE, "row1"),
        TOPICS.meter(SITE, "row2"),
        *(TOPICS.cdu(SITE, cdu) for cdu in ("cdu1", "cdu2", "cdu3")),
        *(TOPICS.loop_state(SITE, loop) for loop in ("loop1", "loop2", "loop3")),
        *(TOPICS.loop_alarms(SITE, loop) for loop in ("loop1", "loop2")),
        TOPICS.aggregator(SITE, "agg1", "status"),
        TOPICS.aggregator(SITE, "agg1", "events"),
        TOPICS.aggregator(SITE, "agg2", "status"),
        # The power tree: budgets (of a row outside the topology too), the site report,
        # limits (one on a domain named like the rack-control channel), and another site's.
        *(TOPICS.budget(SITE, row) for row in ("row1", "row2", "row3")),
        TOPICS.budget("dc2", "row1"),
        TOPICS.site_report(SITE),
        TOPICS.site_report("dc2"),
        TOPICS.budget_limit(SITE, "ups-a"),
        TOPICS.budget_limit(SITE, "control"),
        TOPICS.budget_limit("dc2", "ups-a"),
        "elsewhere/node1/telemetry",
    }
)

S_BUDGETS = [TOPICS.budget(SITE, row) for row in ("row1", "row2", "row3")]
"""The site's budgets: the site controller's and the operator's grants are site-wide (the
site file's rows, whichever aggregator owns them)."""
S_LIMITS = [TOPICS.budget_limit(SITE, "ups-a"), TOPICS.budget_limit(SITE, "control")]
S_SUMMARIES = [TOPICS.row_summary(SITE, row) for row in ("row1", "row2")]

S_CONTROLLED = [
    TOPICS.row_control(SITE, "row1"),
    TOPICS.row_control(SITE, "row2"),
    TOPICS.rack_control(SITE, "row1", "rack1"),
    TOPICS.rack_control(SITE, "row1", "rack2"),
    TOPICS.rack_control(SITE, "row2", "rack9"),
]

S_WRITES = matrix(
    **{name: channels(row, rack, name, *PUBLISHED) for name, (row, rack) in S_NODES.items()},
    cdu1=[TOPICS.cdu(SITE, "cdu1")],
    cdu2=[TOPICS.cdu(SITE, "cdu2")],
    meter_row1=[ROW1_METER],
    meter_row2=[TOPICS.meter(SITE, "row2")],
    polca_scheduler=[node(row, rack, name, "assign") for name, (row, rack) in S_NODES.items()],
    polca_aggregator=[
        *S_CONTROLLED,
        *(TOPICS.policy(SITE, row) for row in ("row1", "row2")),
        *(TOPICS.row_summary(SITE, row) for row in ("row1", "row2")),
        *(TOPICS.loop_state(SITE, loop) for loop in ("loop1", "loop2")),
        *(TOPICS.loop_alarms(SITE, loop) for loop in ("loop1", "loop2")),
        TOPICS.aggregator(SITE, "agg1", "status"),
        TOPICS.aggregator(SITE, "agg1", "events"),
    ],
    polca_viewer=[],
    polca_site=[*S_BUDGETS, TOPICS.site_report(SITE)],
    polca_operator=S_LIMITS,
)

S_READS = matrix(
    **{
        name: [
            TOPICS.row_control(SITE, row),
            TOPICS.rack_control(SITE, row, rack),
            TOPICS.policy(SITE, row),
            node(row, rack, name, "assign"),
        ]
        for name, (row, rack) in S_NODES.items()
    },
    cdu1=[],
    # Simulated: the node telemetry of rack9, the rack its loop cools.
    cdu2=[node("row2", "rack9", "node9", "telemetry"), node("row2", "rack9", "node1", "telemetry")],
    meter_row1=[],
    meter_row2=[],
    polca_scheduler=[
        node(row, rack, name, channel)
        for name, (row, rack) in S_NODES.items()
        for channel in ("status", "assign")
    ],
    polca_aggregator=[
        *(
            node(row, rack, name, channel)
            for name, (row, rack) in S_NODES.items()
            for channel in ("telemetry", "status", "events")
        ),
        node("row1", "rack2", "node1", "telemetry"),
        node("row2", "rack9", "node1", "telemetry"),
        *S_CONTROLLED,
        TOPICS.rack_control(SITE, "row1", "rack7"),
        ROW1_METER,
        TOPICS.meter(SITE, "row2"),
        TOPICS.cdu(SITE, "cdu1"),
        TOPICS.cdu(SITE, "cdu2"),
        TOPICS.budget(SITE, "row1"),
        TOPICS.budget(SITE, "row2"),
    ],
    polca_viewer=[
        *(
            t
            for t in S_UNIVERSE
            if t.startswith((f"polca/v1/{SITE}/row1/", f"polca/v1/{SITE}/row2/"))
        ),
        ROW1_METER,
        TOPICS.cdu(SITE, "cdu1"),
        TOPICS.cdu(SITE, "cdu2"),
        *(TOPICS.loop_state(SITE, loop) for loop in ("loop1", "loop2")),
        *(TOPICS.loop_alarms(SITE, loop) for loop in ("loop1", "loop2")),
        TOPICS.aggregator(SITE, "agg1", "status"),
        TOPICS.aggregator(SITE, "agg1", "events"),
        TOPICS.site_report(SITE),
        *S_LIMITS,
    ],
    # Every row's meter (row1's unused default topic too) and summary, the limits.
    polca_site=[
        ROW1_METER,
        TOPICS.meter(SITE, "row1"),
        TOPICS.meter(SITE, "row2"),
        *S_SUMMARIES,
        *S_LIMITS,
    ],
    # Its own limits read back, the site report, the rows' summaries and budgets.
    polca_operator=[*S_LIMITS, TOPICS.site_report(SITE), *S_SUMMARIES, *S_BUDGETS],
)


@pytest.fixture
def strict_roles(
    tmp_path: Path, deployed_broker: rig.BrokerFactory
) -> tuple[MosquittoProcess, dict[str, str]]:
    """make-acl.py's ACL and users for S_TOPOLOGY (cdu2 simulated), run as documented."""
    config = tmp_path / "aggregator.yaml"
    config.write_text(S_TOPOLOGY, encoding="utf-8")
    acl, script = tmp_path / "strict.acl", tmp_path / "add-users.sh"
    argv: list[str | Path] = [sys.executable, rig.MAKE_ACL, config, "-o", acl]
    result = rig.run_script([*argv, "--passwd-commands", script, "--simulated-cdu", "cdu2"])
    assert result.returncode == 0, result.stderr
    result = rig.run_script(
        ["sh", script],
        PASSWORD_FILE=str(tmp_path / "passwd"),
        SECRETS_DIR=str(tmp_path / "secrets"),
    )
    assert result.returncode == 0, result.stderr
    secrets = {path.stem: path for path in (tmp_path / "secrets").glob("*.pass")}
    assert set(secrets) == set(S_USERS)
    passwords = {user: path.read_text(encoding="utf-8").strip() for user, path in secrets.items()}
    passwords |= rig.make_passwords(tmp_path, rig.TEST_USERS)
    broker = deployed_broker(
        acl=rig.probe_acl(acl, tmp_path / "acl"), password_file=tmp_path / "passwd"
    )
    return broker, passwords


async def test_strict_acl_writes_by_role(
    strict_roles: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """Strict ACL: each user writes exactly its role's topics in its row, rack, loop."""
    broker, passwords = strict_roles
    got = await rig.observed_writes(broker, passwords, S_UNIVERSE)
    assert rig.differences(got, S_WRITES) == {}


async def test_strict_acl_reads_by_role(
    strict_roles: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """Strict ACL: what each user subscribed to # receives, retained and live."""
    broker, passwords = strict_roles
    got = await rig.observed_reads(broker, passwords, S_UNIVERSE)
    assert {kind: rig.differences(seen, S_READS) for kind, seen in got.items()} == {
        "retained": {},
        "live": {},
    }


def test_strict_aggregator_reads_are_its_subscriptions() -> None:
    """The aggregator's reads in S_READS are what its intake subscribes to (the rows'
    budgets included), except a node's topics outside its place (node1 under rack2 and
    row2): the ACL lets the aggregator read them, its subscriptions name each node of the
    topology where it is."""
    settings = AggregatorSettings.model_validate(yaml.safe_load(S_TOPOLOGY))
    rows = RowControl(settings, epoch_ns=0)
    intake = Intake(
        site=settings.site,
        topics=Topics(settings.topic_root),
        trackers=rows.trackers,
        issuer=settings.instance,
        cdus=tuple(loop.cdu for loop in settings.cooling.loops),
        budgets=rows.budgets,
    )
    shards = intake.node_subscriptions(settings.intake.connections)
    filters = [topic_filter for topic_filter, _ in intake.subscriptions()]
    filters += [topic_filter for shard in shards.values() for topic_filter, _ in shard]
    filters += [topic_filter for topic_filter, _ in intake.source_subscriptions()]
    subscribed = [
        topic for topic in S_UNIVERSE if any(aiomqtt.Topic(topic).matches(f) for f in filters)
    ]
    misplaced = {
        node("row1", "rack2", "node1", "telemetry"),
        node("row2", "rack9", "node1", "telemetry"),
    }
    assert sorted(subscribed) == sorted(set(S_READS["polca-aggregator"]) - misplaced)


def site_controller_filters() -> list[str]:
    """What ``polca site run`` subscribes to for the site example's tree in SITE, with
    row1's meter topic among its ``meter_topics``."""
    settings = SiteSettings(site=SITE, instance="site1", meter_topics=(ROW1_METER,))
    core = SiteCore(settings, load_site(SITE_EXAMPLE), epoch_ns=0)
    return [topic_filter for topic_filter, _ in core.subscriptions()]


def test_strict_site_controller_reads_cover_its_subscriptions() -> None:
    """Every topic of the universe the site controller subscribes to (every row's meters,
    the site file's rows' summaries) is one of its reads in S_READS, and it may read
    nothing beyond them but the limits (granted for any domain: the domains are the site
    file's)."""
    filters = site_controller_filters()
    subscribed = {t for t in S_UNIVERSE if any(aiomqtt.Topic(t).matches(f) for f in filters)}
    reads = set(S_READS["polca-site"])
    assert subscribed <= reads
    assert reads - subscribed <= set(S_LIMITS)


# --- Last Wills -------------------------------------------------------------------------


async def _check_last_wills(broker: MosquittoProcess, passwords: dict[str, str]) -> None:
    """A node's and the aggregator's wills: delivered on their own status topic only."""
    node1_status = node("row1", "rack1", "node1", "status")
    aggregator_status = TOPICS.aggregator(SITE, "agg1", "status")
    forbidden = [
        ("node1", node("row1", "rack1", "node2", "status")),
        ("node1", aggregator_status),
        ("polca-aggregator", node1_status),
    ]
    allowed = [("node1", node1_status), ("polca-aggregator", aggregator_status)]
    async with rig.connected(broker, rig.OBSERVER, passwords[rig.OBSERVER]) as observer:
        await observer.subscribe("#", qos=1)
        for user, will in [*forbidden, *allowed]:
            await rig.vanish_with_will(broker, user, passwords[user], will)
        # Connecting after the last vanished client: the broker has handled its end.
        async with rig.connected(broker, rig.WRITER, passwords[rig.WRITER]) as writer:
            await writer.publish(rig.done_topic(rig.OBSERVER), b"", qos=1)
        got = await rig.until_done(observer, rig.OBSERVER)
    assert got == [(will, f"will of {user}".encode()) for user, will in allowed]


async def test_pattern_acl_last_wills(
    pattern_roles: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """Pattern ACL: a vanished node's or aggregator's will is published on its status only."""
    await _check_last_wills(*pattern_roles)


async def test_strict_acl_last_wills(
    strict_roles: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """Strict ACL: a vanished node's or aggregator's will is published on its status only."""
    await _check_last_wills(*strict_roles)


async def test_polca_status_reads_the_shipped_broker_as_the_viewer_in_json(
    tmp_path: Path, pattern_roles: tuple[MosquittoProcess, dict[str, str]]
) -> None:
    """`polca status --username polca-viewer --password-file ... --json` against the shipped
    configuration (no anonymous access) lists what a node published retained; without
    credentials it fails with the broker named, instead of printing an empty site."""
    import json as json_module
    import time

    from polca.telemetry.schema import Status, encode
    from tests.integration.rig import polca_status

    broker, passwords = pattern_roles
    status = Status(ts_ns=time.time_ns(), state="online", node="node1", gpu_count=8)
    async with rig.connected(broker, "node1", passwords["node1"]) as client:
        await client.publish(
            node("row1", "rack1", "node1", "status"), encode(status), qos=1, retain=True
        )
    password_file = tmp_path / "viewer.pass"
    password_file.write_text(passwords["polca-viewer"] + "\n", encoding="utf-8")
    viewer = await polca_status(
        broker,
        "--wait=1.5",
        "--username=polca-viewer",
        f"--password-file={password_file}",
        "--json",
    )
    assert viewer.returncode == 0, viewer.stderr
    snapshot = json_module.loads(viewer.stdout)
    (entry,) = [n for n in snapshot["nodes"] if n["node"] == "node1"]
    assert (entry["site"], entry["row"], entry["rack"]) == (SITE, "row1", "rack1")
    assert entry["status"]["state"] == "online"
    assert entry["status"]["gpu_count"] == 8
    anonymous = await polca_status(broker, "--wait=1.5", "--json")
    assert anonymous.returncode == 77  # refused: EX_NOPERM, one line, no traceback
    assert f"{broker.host}:{broker.port}" in anonymous.stderr
    assert "Traceback" not in anonymous.stderr
