#!/usr/bin/env python3
"""Write a strict Mosquitto ACL, and the commands that create its users, from a topology.

Why this exists: the pattern ACL next to this script (``acl``) names a user only through
``%u``, and a Mosquitto substitution fills one whole topic level, so it cannot tie a node
to its row and rack (node1 could write ``node1`` telemetry under any row and read every
row's control). This script reads the aggregator's configuration (site -> rows -> racks ->
nodes, and the cooling loops with their CDUs) and writes one ``user`` section per user
naming its exact topics, and no ``pattern`` line at all:

- a node agent per node (user = node name): writes its telemetry, status, state and events
  under its own row and rack; reads its row's control and policy, its rack's control and
  its own assignment;
- the aggregator: reads the node channels, control, meters, budgets and CDUs of its rows
  and loops; writes their control, policy and summary, the loops' state and alarms, and
  its own status and events;
- a CDU source per CDU (user = CDU id: the CDU itself, its ``polca cdu modbus`` poller, or
  a ``polca cdu simulate``, which with ``--simulated-cdu`` may also read the node telemetry
  of the racks its loop cools): writes that CDU's telemetry only;
- a meter per row (``meter-<row>``): writes the row's ``meter_topic`` (or the default
  ``{root}/{site}/{row}/meter``, where the aggregator listens when none is set);
- the scheduler: writes (and reads back) every node's assignment, reads node status;
- the site controller (``polca site run``, user ``polca-site``), site-wide since its rows
  are those of the site file: reads every row's meter and summary and the operators'
  limits, writes the rows' budgets and the site report (``{root}/{site}/powertree/state``);
- the operator (``polca budget``, user ``polca-operator``), site-wide: writes (and reads
  back) the limits ``{root}/{site}/powertree/limit/{domain}``, reads the site report and
  the rows' summaries and budgets;
- the viewer (``polca status``, dashboards' helpers): reads everything above, writes nothing.

Rerun it whenever the topology changes, then ``systemctl reload mosquitto``. It must run
on a broker host without polca installed, so it uses the standard library only, plus
PyYAML (Debian ``python3-yaml``) when the configuration is YAML; a ``.json`` configuration
needs nothing else. It never touches the broker: it writes files.

    make-acl.py /etc/polca/aggregator.yaml -o /etc/mosquitto/acl \
        --passwd-commands add-users.sh
    PASSWORD_FILE=/etc/mosquitto/passwd SECRETS_DIR=./mqtt-secrets sh add-users.sh
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = "polca/v1"
"""Default topic root, schema version included (the configuration's ``topic_root``)."""

_SEGMENT = re.compile(r"\A[A-Za-z0-9_.-]+\Z")
"""A site, row, rack or node name (one topic level), and every user name (``\\Z``: no
trailing newline either, which would end an ACL or script line)."""

_LOOP_NAME = re.compile(r"\A[A-Za-z0-9_.:-]+\Z")
"""A cooling loop's name: one topic level; polca's cooling configuration also allows ':'."""

RESERVED_ROWS = ("aggregator", "cooling", "powertree")
"""Levels after the site that are not rows: the aggregators' own topics, the cooling
topics and the power tree's. A row named ``cooling`` would make a node's ``state`` topic
the topic of a loop's state (``{site}/cooling/loop/{loop}/state``)."""

_NODE_PUBLISHES = ("telemetry", "status", "state", "events")
"""The channels a node agent writes under its own topic."""

_CHANNELS = frozenset(
    {*_NODE_PUBLISHES, "assign", "control", "policy", "summary", "alarms", "budget"}
)
"""Last levels of polca's own topics: a meter topic under the root must not end in one."""


class TopologyError(ValueError):
    """The configuration does not describe a usable topology."""


@dataclass(frozen=True, slots=True)
class Rack:
    """One rack and the names of its nodes."""

    name: str
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Row:
    """One row (power domain): its racks and the topic its meter publishes on."""

    name: str
    racks: tuple[Rack, ...]
    meter_topic: str
    """The configured ``meter_topic``, else the default one the aggregator listens on."""


@dataclass(frozen=True, slots=True)
class Loop:
    """One cooling loop: its name, the CDU that drives it and the racks it cools."""

    name: str
    cdu: str
    racks: tuple[tuple[str, str], ...]
    """(row, rack) of every rack the loop cools."""


@dataclass(frozen=True, slots=True)
class Topology:
    """What one aggregator owns, in one site, under one topic root."""

    site: str
    rows: tuple[Row, ...]
    loops: tuple[Loop, ...] = ()
    root: str = ROOT
    instance: str | None = None
    """The aggregator's ``instance`` (its status topic); None: not in the configuration."""
    aggregator_user: str | None = None
    """The configuration's ``mqtt.username``, if set."""


@dataclass(frozen=True, slots=True)
class ServiceUsers:
    """User names of the processes that are not node agents or CDU sources."""

    aggregator: str = "polca-aggregator"
    """The aggregator (``mqtt.username`` of its configuration)."""
    scheduler: str = "polca-scheduler"
    """Whatever publishes priority assignments."""
    viewer: str = "polca-viewer"
    """Read-only: ``polca status``, dashboards' helpers, operators."""
    site: str = "polca-site"
    """The site controller (``polca site run``): the only writer of the rows' budgets."""
    operator: str = "polca-operator"
    """``polca budget``: the only writer of the power tree's limits."""

    def meter(self, row: str) -> str:
        """The user name of a row's power meter."""
        return f"meter-{row}"


def _segment(kind: str, value: object, where: str) -> str:
    if not isinstance(value, str) or not _SEGMENT.match(value):
        msg = f"{where}: {kind} name {value!r} is not one topic level (letters, digits, _ . -)"
        raise TopologyError(msg)
    return value


def _items(value: object, what: str, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        msg = f"{where}: {what} must be a non-empty list"
        raise TopologyError(msg)
    for item in value:
        if not isinstance(item, dict):
            msg = f"{where}: every entry of {what} must be a mapping, not {item!r}"
            raise TopologyError(msg)
    return value


def _plain_topic(value: object, what: str) -> str:
    """``value`` if it is a topic without wildcards, blank levels or a leading ``$``."""
    if (
        not isinstance(value, str)
        or value.startswith("$")
        or any(not level or re.search(r"[+#\s\x00]", level) for level in value.split("/"))
    ):
        msg = f"{what} {value!r} must be a plain topic (no wildcard, no blank level, no $)"
        raise TopologyError(msg)
    return value


def _meter_topic(value: object, *, root: str, site: str, row: str) -> str:
    """A row's meter topic, refused when it is (or could be) another polca topic."""
    if value is None:
        return f"{root}/{site}/{row}/meter"
    topic = _plain_topic(value, f"row {row}: meter_topic")
    if topic.startswith(f"{root}/"):
        levels = topic[len(root) + 1 :].split("/")
        if levels[-1] in _CHANNELS or (len(levels) > 1 and levels[1] in RESERVED_ROWS):
            msg = (
                f"row {row}: meter_topic {topic!r} is (or may become) another polca topic; "
                f"its meter could then write it"
            )
            raise TopologyError(msg)
    return topic


def _user_name(kind: str, value: str) -> str:
    if not _SEGMENT.match(value):
        msg = f"{kind} user name {value!r} must be letters, digits, _ . - only"
        raise TopologyError(msg)
    return value


def _rows(raw: dict[str, Any], *, root: str, site: str) -> tuple[Row, ...]:
    rows: list[Row] = []
    seen_nodes: dict[str, str] = {}
    meters: dict[str, str] = {}
    for row_raw in _items(raw.get("rows"), "rows", "rows"):
        row = _segment("row", row_raw.get("name"), "rows[]")
        if row in RESERVED_ROWS:
            msg = f"row name {row!r} is reserved: {root}/{site}/{row}/ holds polca's own topics"
            raise TopologyError(msg)
        if any(existing.name == row for existing in rows):
            msg = f"row {row!r} is listed twice"
            raise TopologyError(msg)
        racks: list[Rack] = []
        for rack_raw in _items(row_raw.get("racks"), "racks", f"row {row}"):
            rack = _segment("rack", rack_raw.get("name"), f"row {row}")
            if any(existing.name == rack for existing in racks):
                msg = f"row {row}: rack {rack!r} is listed twice"
                raise TopologyError(msg)
            where = f"row {row} rack {rack}"
            nodes = tuple(
                _segment("node", node_raw.get("name"), where)
                for node_raw in _items(rack_raw.get("nodes"), "nodes", where)
            )
            for node in nodes:
                if node in seen_nodes:
                    msg = (
                        f"node {node!r} appears in {seen_nodes[node]} and in {where}: node "
                        "names are MQTT user names and must be unique"
                    )
                    raise TopologyError(msg)
                seen_nodes[node] = where
            racks.append(Rack(rack, nodes))
        meter = _meter_topic(row_raw.get("meter_topic"), root=root, site=site, row=row)
        if meter in meters:
            msg = f"rows {meters[meter]} and {row} have the same meter topic {meter!r}"
            raise TopologyError(msg)
        meters[meter] = row
        rows.append(Row(row, tuple(racks), meter))
    return tuple(rows)


def _loops(raw: object, rows: tuple[Row, ...]) -> tuple[Loop, ...]:
    """The cooling loops of ``cooling.loops``, each rack placed in its row."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        msg = "cooling must be a mapping with 'loops'"
        raise TopologyError(msg)
    if not raw.get("loops"):
        return ()
    rows_of: dict[str, list[str]] = {}
    for row in rows:
        for rack in row.racks:
            rows_of.setdefault(rack.name, []).append(row.name)
    loops: list[Loop] = []
    cooled: dict[str, str] = {}
    for loop_raw in _items(raw["loops"], "cooling.loops", "cooling"):
        name = loop_raw.get("name")
        if not isinstance(name, str) or not _LOOP_NAME.match(name):
            msg = f"cooling: loop name {name!r} is not one topic level (letters, digits, _ . : -)"
            raise TopologyError(msg)
        if any(existing.name == name for existing in loops):
            msg = f"cooling: loop {name!r} is listed twice"
            raise TopologyError(msg)
        cdu = loop_raw.get("cdu")
        if not isinstance(cdu, str) or not _SEGMENT.match(cdu):
            msg = (
                f"loop {name}: CDU id {cdu!r} must be letters, digits, _ . - (it is the CDU's "
                "MQTT user name; ':' would end the name in the password file)"
            )
            raise TopologyError(msg)
        if any(existing.cdu == cdu for existing in loops):
            msg = f"loop {name}: CDU {cdu!r} already drives another loop"
            raise TopologyError(msg)
        racks_raw = loop_raw.get("racks")
        if not isinstance(racks_raw, list) or not racks_raw:
            msg = f"loop {name}: racks must be a non-empty list"
            raise TopologyError(msg)
        racks: list[tuple[str, str]] = []
        for rack in racks_raw:
            rack_rows = rows_of.get(rack, []) if isinstance(rack, str) else []
            if len(rack_rows) != 1:
                msg = (
                    f"loop {name}: rack {rack!r} must be a rack of exactly one row, "
                    f"found in {rack_rows or 'none'}"
                )
                raise TopologyError(msg)
            if rack in cooled:
                msg = f"rack {rack} is cooled by two loops: {cooled[rack]} and {name}"
                raise TopologyError(msg)
            cooled[rack] = name
            racks.append((rack_rows[0], rack))
        loops.append(Loop(name, cdu, tuple(racks)))
    return tuple(loops)


def parse_topology(raw: object, *, root: str | None = None) -> Topology:
    """The topology of a parsed aggregator configuration; other keys are ignored.

    ``root`` overrides the configuration's ``topic_root``. Raises ``TopologyError`` naming
    the first problem: a name that is not one topic level, a reserved row name, a node,
    rack, row, loop or CDU listed twice, a meter topic that is another polca topic, a
    loop's rack that is in no row.
    """
    if not isinstance(raw, dict):
        msg = "the configuration must be a mapping with 'site' and 'rows'"
        raise TopologyError(msg)
    root = _plain_topic(root or raw.get("topic_root") or ROOT, "topic root")
    site = _segment("site", raw.get("site"), "site")
    instance = raw.get("instance")
    if instance is not None:
        instance = _segment("aggregator instance", instance, "instance")
    mqtt = raw.get("mqtt")
    username = mqtt.get("username") if isinstance(mqtt, dict) else None
    if username is not None:
        username = _segment("aggregator user", username, "mqtt.username")
    rows = _rows(raw, root=root, site=site)
    loops = _loops(raw.get("cooling"), rows)
    return Topology(site, rows, loops, root, instance, username)


def load_topology(path: Path, *, root: str | None = None) -> Topology:
    """Read an aggregator configuration file (YAML, or JSON for a ``.json`` name)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        msg = f"cannot read {path}: {exc}"
        raise TopologyError(msg) from exc
    if path.suffix == ".json":
        try:
            raw: object = json.loads(text)
        except ValueError as exc:
            msg = f"{path}: not valid JSON: {exc}"
            raise TopologyError(msg) from exc
        return parse_topology(raw, root=root)
    try:
        import yaml  # noqa: PLC0415 - optional: only YAML configurations need it
    except ImportError as exc:
        msg = f"reading {path} needs PyYAML (apt-get install python3-yaml), or give a .json file"
        raise TopologyError(msg) from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        msg = f"{path}: not valid YAML: {exc}"
        raise TopologyError(msg) from exc
    return parse_topology(raw, root=root)


def user_names(topology: Topology, users: ServiceUsers) -> list[str]:
    """Every user the strict ACL names: services, meters, CDUs, then nodes."""
    names = [
        _user_name("aggregator", users.aggregator),
        _user_name("scheduler", users.scheduler),
        _user_name("viewer", users.viewer),
        _user_name("site controller", users.site),
        _user_name("operator", users.operator),
    ]
    names += [users.meter(row.name) for row in topology.rows]
    names += [loop.cdu for loop in topology.loops]
    names += [node for row in topology.rows for rack in row.racks for node in rack.nodes]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        msg = (
            f"user names used twice (a node or CDU named like another user?): {', '.join(clashes)}"
        )
        raise TopologyError(msg)
    return names


def _aggregator(topology: Topology, user: str) -> list[str]:
    site = f"{topology.root}/{topology.site}"
    instance = topology.instance or "+"
    pinned = "" if topology.instance else " (any instance: set `instance:` to pin it)"
    out = [
        f"# The aggregator{pinned}: reads the node channels, control, meters, budgets and",
        "# CDUs of its rows and loops; writes their control, policy and summary, the loops'",
        "# state and alarms, and its own status (retained, also its Last Will) and events.",
        f"user {user}",
    ]
    for row in topology.rows:
        out += [
            f"topic read {site}/{row.name}/+/+/{ch}" for ch in ("telemetry", "status", "events")
        ]
        out += [f"topic read {row.meter_topic}", f"topic read {site}/{row.name}/budget"]
        # Control is read back, as the aggregator subscribes to it: another issuer on its
        # rows is reported (foreign_control).
        out += [
            f"topic readwrite {site}/{row.name}/control",
            f"topic read {site}/{row.name}/+/control",
        ]
        out += [f"topic write {site}/{row.name}/{rack.name}/control" for rack in row.racks]
        out += [f"topic write {site}/{row.name}/policy", f"topic write {site}/{row.name}/summary"]
    for loop in topology.loops:
        out += [
            f"topic read {site}/cooling/{loop.cdu}/telemetry",
            f"topic write {site}/cooling/loop/{loop.name}/state",
            f"topic write {site}/cooling/loop/{loop.name}/alarms",
        ]
    out += [
        f"topic write {site}/aggregator/{instance}/status",
        f"topic write {site}/aggregator/{instance}/events",
        "",
    ]
    return out


def _services(topology: Topology, users: ServiceUsers) -> list[str]:
    site = f"{topology.root}/{topology.site}"
    out = [
        "# The scheduler: writes (and reads back) the priority assignment of every node;",
        "# reads node status.",
        f"user {users.scheduler}",
    ]
    for row in topology.rows:
        out += [f"topic readwrite {site}/{row.name}/+/+/assign"]
        out += [f"topic read {site}/{row.name}/+/+/status"]
    out += [
        "",
        "# Read-only access for operators (`polca status`) and tools: everything of these",
        "# rows, loops, this aggregator and the site's power tree; nothing written.",
        f"user {users.viewer}",
    ]
    for row in topology.rows:
        out += [f"topic read {site}/{row.name}/#"]
        if not row.meter_topic.startswith(f"{site}/{row.name}/"):
            out += [f"topic read {row.meter_topic}"]
    for loop in topology.loops:
        out += [
            f"topic read {site}/cooling/{loop.cdu}/telemetry",
            f"topic read {site}/cooling/loop/{loop.name}/#",
        ]
    out += [
        f"topic read {site}/aggregator/{topology.instance or '+'}/#",
        f"topic read {site}/powertree/#",
        "",
        *_power_tree(topology, users),
    ]
    for row in topology.rows:
        out += [
            f"# The power meter of row {row.name}: writes the row's meter topic only.",
            f"user {users.meter(row.name)}",
            f"topic write {row.meter_topic}",
            "",
        ]
    return out


def _power_tree(topology: Topology, users: ServiceUsers) -> list[str]:
    """The site controller's and the operator's sections: site-wide, since the rows and
    domains they serve are the site file's (several aggregators' rows), not this
    configuration's."""
    site = f"{topology.root}/{topology.site}"
    out = [
        "# The site controller (`polca site run`): reads every row's meter and summary and",
        "# the operators' limits; writes the rows' leased budgets and the site report.",
        f"user {users.site}",
        f"topic read {site}/+/meter",
    ]
    out += [
        f"topic read {row.meter_topic}"
        for row in topology.rows
        if row.meter_topic != f"{site}/{row.name}/meter"
    ]
    out += [
        f"topic read {site}/+/summary",
        f"topic read {site}/powertree/limit/+",
        f"topic write {site}/+/budget",
        f"topic write {site}/powertree/state",
        "",
        "# The operator (`polca budget`): writes (and reads back) the limits on the power",
        "# tree's domains; reads the site report and the rows' summaries and budgets.",
        f"user {users.operator}",
        f"topic readwrite {site}/powertree/limit/+",
        f"topic read {site}/powertree/state",
        f"topic read {site}/+/summary",
        f"topic read {site}/+/budget",
        "",
    ]
    return out


def _cdus(topology: Topology, simulated: Collection[str]) -> list[str]:
    site = f"{topology.root}/{topology.site}"
    out: list[str] = []
    for loop in topology.loops:
        out += [
            f"# CDU {loop.cdu} of loop {loop.name} (the CDU itself, its `polca cdu modbus`",
            "# poller or a `polca cdu simulate`): writes its own telemetry only.",
            f"user {loop.cdu}",
            f"topic write {site}/cooling/{loop.cdu}/telemetry",
        ]
        if loop.cdu in simulated:
            out += ["# Simulated (--simulated-cdu): its heat input is the telemetry of its racks."]
            out += [f"topic read {site}/{row}/{rack}/+/telemetry" for row, rack in loop.racks]
        out += [""]
    return out


def _nodes(topology: Topology) -> list[str]:
    site = f"{topology.root}/{topology.site}"
    out: list[str] = []
    for row in topology.rows:
        for rack in row.racks:
            rack_topic = f"{site}/{row.name}/{rack.name}"
            for node in rack.nodes:
                out += [f"# Node agent {node} in row {row.name}, rack {rack.name}.", f"user {node}"]
                out += [f"topic write {rack_topic}/{node}/{ch}" for ch in _NODE_PUBLISHES]
                out += [
                    f"topic read {rack_topic}/{node}/assign",
                    f"topic read {site}/{row.name}/control",
                    f"topic read {rack_topic}/control",
                    f"topic read {site}/{row.name}/policy",
                    "",
                ]
    return out


def acl_text(
    topology: Topology,
    users: ServiceUsers,
    *,
    source: str,
    simulated: Collection[str] = (),
) -> str:
    """The strict ACL: one ``user`` section per user, each granting exact topics.

    ``simulated`` names CDUs run by ``polca cdu simulate --rack``: they may also read the
    node telemetry of the racks their loop cools.
    """
    user_names(topology, users)  # refuse clashing names before writing anything
    unknown = sorted(set(simulated) - {loop.cdu for loop in topology.loops})
    if unknown:
        msg = f"--simulated-cdu names no CDU of the configuration: {', '.join(unknown)}"
        raise TopologyError(msg)
    out = [
        f"# Strict Mosquitto ACL for polca, generated by make-acl.py from {source}.",
        "# Do not edit: change the configuration and run make-acl.py again. There are no",
        "# pattern lines: every user has exactly the topics of its own section, and",
        "# everything else is denied. Roles: deploy/mosquitto/README.md; topics: docs/mqtt.md.",
        "",
    ]
    out += _aggregator(topology, users.aggregator)
    out += _services(topology, users)
    out += _cdus(topology, simulated)
    out += _nodes(topology)
    return "\n".join(out)


_ADD_USER = """\
# add_user NAME: a random password for NAME, kept in $SECRETS_DIR/NAME.pass (reused when
# present) and hashed into $PASSWORD_FILE; the password goes to mosquitto_passwd on stdin,
# never on a command line.
add_user() {
  secret="$SECRETS_DIR/$1.pass"
  if [ ! -s "$secret" ]; then
    od -An -tx1 -N16 /dev/urandom | tr -d ' \\n' > "$secret"
    echo >> "$secret"
  fi
  password=$(head -n 1 "$secret")
  printf '%s\\n%s\\n' "$password" "$password" \\
    | mosquitto_passwd "$PASSWORD_FILE" "$1" > /dev/null
  echo "$1: $secret"
}
"""


def passwd_commands(names: list[str], *, source: str) -> str:
    """A POSIX shell script that adds every user in ``names`` to the password file."""
    lines = [
        "#!/bin/sh",
        f"# Generated by make-acl.py from {source}: creates or updates the Mosquitto users of",
        "# the strict ACL. Copy each node's SECRETS_DIR/<node>.pass to that node as",
        "# /etc/polca/mqtt.pass (mode 600), the aggregator's as /etc/polca/aggregator-mqtt.pass,",
        "# the site controller's as /etc/polca/site-mqtt.pass, each CDU's to the host that",
        "# publishes for it.",
        "set -eu",
        "# The broker's password file (created, mode 600, if missing).",
        'PASSWORD_FILE="${PASSWORD_FILE:-/etc/mosquitto/passwd}"',
        "# Where the plain passwords are kept for distribution (mode 700).",
        'SECRETS_DIR="${SECRETS_DIR:-./mqtt-secrets}"',
        "umask 077",
        'mkdir -p "$SECRETS_DIR"',
        '[ -e "$PASSWORD_FILE" ] || : > "$PASSWORD_FILE"',
        _ADD_USER,
    ]
    lines += [f"add_user {name}" for name in names]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write ``path`` through a temporary file, so a broker reload never reads half of it."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    if mode is not None:
        partial.chmod(mode)
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Command line: write the ACL (and optionally the password commands); 0 on success."""
    parser = argparse.ArgumentParser(
        prog="make-acl.py",
        description="Strict per-user Mosquitto ACL from a polca aggregator configuration.",
    )
    parser.add_argument("config", type=Path, help="aggregator configuration (YAML or .json)")
    parser.add_argument("-o", "--output", type=Path, help="ACL file to write (default: stdout)")
    parser.add_argument(
        "--passwd-commands", type=Path, help="also write a shell script adding every user"
    )
    parser.add_argument(
        "--root", default=None, help=f"topic root (default: topic_root, else {ROOT})"
    )
    defaults = ServiceUsers()
    parser.add_argument(
        "--aggregator-user",
        default=None,
        help=f"default: the configuration's mqtt.username, else {defaults.aggregator}",
    )
    parser.add_argument("--scheduler-user", default=defaults.scheduler)
    parser.add_argument("--viewer-user", default=defaults.viewer)
    parser.add_argument("--site-user", default=defaults.site, help="the site controller")
    parser.add_argument("--operator-user", default=defaults.operator, help="polca budget")
    parser.add_argument(
        "--simulated-cdu",
        action="append",
        default=[],
        metavar="CDU",
        help="a CDU run by `polca cdu simulate --rack`: it also reads its racks' node "
        "telemetry (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        topology = load_topology(args.config, root=args.root)
        aggregator = args.aggregator_user or topology.aggregator_user or defaults.aggregator
        users = ServiceUsers(
            aggregator, args.scheduler_user, args.viewer_user, args.site_user, args.operator_user
        )
        text = acl_text(topology, users, source=str(args.config), simulated=args.simulated_cdu)
        names = user_names(topology, users)
    except TopologyError as exc:
        sys.stderr.write(f"make-acl.py: error: {exc}\n")
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        _write(args.output, text)
    if args.passwd_commands is not None:
        _write(args.passwd_commands, passwd_commands(names, source=str(args.config)), mode=0o700)
    return 0


if __name__ == "__main__":
    sys.exit(main())
