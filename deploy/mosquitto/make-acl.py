#!/usr/bin/env python3
"""Write a strict Mosquitto ACL, and the commands that create its users, from a topology.

Why this exists: the pattern ACL next to this script (``acl``) names a node only through
``%u``, and a Mosquitto substitution must fill a whole topic level, so it cannot tie a user
to a row and rack; node1 could then write ``node1`` telemetry under any row and read every
row's control. This script reads the aggregator's configuration (site -> rows -> racks ->
nodes) and writes one ``user`` section per node that names its exact topics, plus sections
for the aggregator (its rows only), the scheduler, a read-only viewer and one meter user
per row that has a ``meter_topic``. Rerun it whenever the topology changes, then
``systemctl reload mosquitto``.

It must run on a broker host without polca installed, so it uses the standard library
only, plus PyYAML (Debian ``python3-yaml``) when the configuration is YAML; a ``.json``
configuration needs nothing else. It never touches the broker: it writes files.

    make-acl.py /etc/polca/aggregator.yaml -o /etc/mosquitto/acl \
        --passwd-commands add-users.sh
    PASSWORD_FILE=/etc/mosquitto/passwd SECRETS_DIR=./mqtt-secrets sh add-users.sh
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = "polca/v1"
"""Topic root, schema version included (``topics.root`` in polca's settings)."""

_SEGMENT = re.compile(r"^[A-Za-z0-9_.-]+$")
"""What polca accepts as a site, row, rack or node name (one topic level)."""

_AGGREGATOR_LEVEL = "aggregator"
"""The level after the site under which aggregators publish their status and events."""

_NODE_PUBLISHES = ("telemetry", "status", "state", "events")
"""The channels a node agent writes under its own topic."""


class TopologyError(ValueError):
    """The configuration does not describe a usable topology."""


@dataclass(frozen=True, slots=True)
class Rack:
    """One rack and the names of its nodes."""

    name: str
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Row:
    """One row (power domain): its racks and, optionally, where its meter publishes."""

    name: str
    racks: tuple[Rack, ...]
    meter_topic: str | None


@dataclass(frozen=True, slots=True)
class Topology:
    """The rows one aggregator owns, in one site."""

    site: str
    rows: tuple[Row, ...]


@dataclass(frozen=True, slots=True)
class ServiceUsers:
    """User names of the processes that are not node agents."""

    aggregator: str = "polca-aggregator"
    """The aggregator (``mqtt.username`` of its configuration)."""
    scheduler: str = "polca-scheduler"
    """Whatever publishes priority assignments."""
    viewer: str = "polca-viewer"
    """Read-only: ``polca status``, dashboards' helpers, operators."""

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
    """``value`` if it is a topic without wildcards or blank levels, else TopologyError."""
    if not isinstance(value, str) or any(
        not level or re.search(r"[+#\s\x00]", level) for level in value.split("/")
    ):
        msg = f"{what} {value!r} must be a plain topic (no wildcard, no blank level)"
        raise TopologyError(msg)
    return value


def parse_topology(raw: object) -> Topology:
    """The topology of a parsed aggregator configuration; other keys are ignored.

    Raises ``TopologyError`` naming the first problem: a name that is not one topic level,
    a node name used twice (it is the MQTT user name), a rack or row name used twice.
    """
    if not isinstance(raw, dict):
        msg = "the configuration must be a mapping with 'site' and 'rows'"
        raise TopologyError(msg)
    site = _segment("site", raw.get("site"), "site")
    rows: list[Row] = []
    seen_nodes: dict[str, str] = {}
    for row_raw in _items(raw.get("rows"), "rows", "rows"):
        row = _segment("row", row_raw.get("name"), "rows[]")
        if row == _AGGREGATOR_LEVEL:
            msg = f"row name {row!r} is reserved for the aggregators' own topics"
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
        meter_raw = row_raw.get("meter_topic")
        meter = None if meter_raw is None else _plain_topic(meter_raw, f"row {row}: meter_topic")
        rows.append(Row(row, tuple(racks), meter))
    return Topology(site, tuple(rows))


def load_topology(path: Path) -> Topology:
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
        return parse_topology(raw)
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
    return parse_topology(raw)


def user_names(topology: Topology, users: ServiceUsers) -> list[str]:
    """Every user the strict ACL names: services first, then meters, then nodes."""
    names = [users.aggregator, users.scheduler, users.viewer]
    names += [users.meter(row.name) for row in topology.rows if row.meter_topic]
    names += [node for row in topology.rows for rack in row.racks for node in rack.nodes]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        msg = f"user names used twice (a node named like a service user?): {', '.join(clashes)}"
        raise TopologyError(msg)
    return names


def acl_text(topology: Topology, users: ServiceUsers, *, source: str, root: str = ROOT) -> str:
    """The strict ACL: one ``user`` section per user, each granting exact topics."""
    site = f"{root}/{topology.site}"
    user_names(topology, users)  # refuse clashing names before writing anything
    out = [
        f"# Strict Mosquitto ACL for polca, generated by make-acl.py from {source}.",
        "# Do not edit: change the topology and run make-acl.py again. Everything not",
        "# granted below is denied. Topic layout: docs/mqtt.md.",
        "",
        "# The aggregator: reads its rows; writes their control, policy and summary, and its",
        "# own status and events.",
        f"user {users.aggregator}",
    ]
    for row in topology.rows:
        out += [f"topic read {site}/{row.name}/#"]
        if row.meter_topic and not row.meter_topic.startswith(f"{site}/{row.name}/"):
            out += [f"topic read {row.meter_topic}"]
        out += [
            f"topic write {site}/{row.name}/control",
            f"topic write {site}/{row.name}/policy",
            f"topic write {site}/{row.name}/summary",
        ]
        out += [f"topic write {site}/{row.name}/{rack.name}/control" for rack in row.racks]
    out += [f"topic readwrite {site}/{_AGGREGATOR_LEVEL}/#", ""]
    out += [
        "# The scheduler: priority assignments of every node, and node liveness.",
        f"user {users.scheduler}",
    ]
    for row in topology.rows:
        out += [f"topic readwrite {site}/{row.name}/+/+/assign"]
        out += [f"topic read {site}/{row.name}/+/+/status"]
    out += [
        "",
        "# Read-only access for operators (`polca status`) and tools.",
        f"user {users.viewer}",
    ]
    out += [f"topic read {site}/{row.name}/#" for row in topology.rows]
    out += [f"topic read {site}/{_AGGREGATOR_LEVEL}/#", ""]
    for row in topology.rows:
        if row.meter_topic:
            out += [
                f"# The power meter of row {row.name}.",
                f"user {users.meter(row.name)}",
                f"topic write {row.meter_topic}",
                "",
            ]
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
        "# /etc/polca/mqtt.pass (mode 600), the aggregator's as /etc/polca/aggregator-mqtt.pass.",
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


def main(argv: list[str] | None = None) -> int:
    """Command line: write the ACL (and optionally the password commands); 0 on success."""
    parser = argparse.ArgumentParser(
        prog="make-acl.py",
        description="Strict per-node Mosquitto ACL from a polca aggregator configuration.",
    )
    parser.add_argument("config", type=Path, help="aggregator configuration (YAML or .json)")
    parser.add_argument("-o", "--output", type=Path, help="ACL file to write (default: stdout)")
    parser.add_argument(
        "--passwd-commands", type=Path, help="also write a shell script adding every user"
    )
    parser.add_argument("--root", default=ROOT, help=f"topic root (default: {ROOT})")
    defaults = ServiceUsers()
    parser.add_argument("--aggregator-user", default=defaults.aggregator)
    parser.add_argument("--scheduler-user", default=defaults.scheduler)
    parser.add_argument("--viewer-user", default=defaults.viewer)
    args = parser.parse_args(argv)
    users = ServiceUsers(args.aggregator_user, args.scheduler_user, args.viewer_user)
    try:
        _plain_topic(args.root, "--root")
        topology = load_topology(args.config)
        text = acl_text(topology, users, source=str(args.config), root=args.root)
        names = user_names(topology, users)
    except TopologyError as exc:
        sys.stderr.write(f"make-acl.py: error: {exc}\n")
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    if args.passwd_commands is not None:
        script = passwd_commands(names, source=str(args.config))
        args.passwd_commands.write_text(script, encoding="utf-8")
        args.passwd_commands.chmod(0o700)
    return 0


if __name__ == "__main__":
    sys.exit(main())
