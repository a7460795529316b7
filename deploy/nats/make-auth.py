#!/usr/bin/env python3
"""Write NATS server users and permissions for polca (auth.conf) from a topology.

Why this exists: on a NATS cluster's MQTT gateway, who may publish and subscribe to what
is NATS subject permissions, not a Mosquitto ACL. The grants are the strict ACL's, which
``deploy/mosquitto/make-acl.py`` builds from the aggregator's configuration (one home for
who may do what): this script loads that script, asks it for the ACL of each
configuration, reads the ACL back section by section and converts each user's MQTT topic
filters into NATS subjects (``/`` -> ``.``, ``.`` -> ``//``, ``+`` -> ``*``, ``#`` -> ``>``
plus the level above, as the gateway maps them): ``read`` grants become subscribe
permissions, ``write`` grants publish permissions.

Only the strict, per-user form exists: a NATS configuration has no ``%u`` patterns.

NATS checks a subscription when it is made, not each message it delivers, and refuses a
filter wider than the user's grants (Mosquitto accepts it and filters what it delivers).
So the three clients that subscribe wider than the strict ACL's grants are given their
filters as they subscribe them (``_wide_reads``): ``polca status`` (the viewer) the whole
site's summary, control, node status and state and aggregator status; ``polca assign``
(the scheduler) each node's status in any row and rack; ``polca cdu simulate --rack``
(a simulated CDU) the node telemetry of each whole row of its racks. The site controller
(``polca-site``) and the operator (``polca-operator``, ``polca budget``) subscribe within
their grants, which are site-wide already (``{site}/+/meter``, ``{site}/+/budget``, ...).

Passwords are random (128 bits), kept in ``SECRETS_DIR/<user>.pass`` (mode 600, reused
when present, like the Mosquitto scripts) and written as they are into ``auth.conf``
(mode 600): NATS compares plain or bcrypt passwords, and bcrypt needs a library outside
the standard library. The server logs one warning about plain passwords at start.

It must run on a broker host without polca installed: the standard library only, plus
PyYAML (Debian ``python3-yaml``) for YAML configurations, as make-acl.py. It never touches
the broker: it writes files.

    make-auth.py /etc/polca/aggregator.yaml -o /etc/nats/auth.conf --secrets-dir ./secrets
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

MAKE_ACL = Path(__file__).resolve().parent.parent / "mosquitto" / "make-acl.py"
"""The strict ACL generator whose topology parsing and grants this script converts."""


def _load_make_acl() -> ModuleType:
    spec = importlib.util.spec_from_file_location("polca_make_acl", MAKE_ACL)
    if spec is None or spec.loader is None:
        msg = f"cannot load {MAKE_ACL}"
        raise ImportError(msg)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


acl: Any = _load_make_acl()
"""deploy/mosquitto/make-acl.py: ``load_topology``, ``acl_text``, ``ServiceUsers``, ..."""

TopologyError: type[Exception] = acl.TopologyError

SECRETS_DIR = Path("nats-secrets")
"""Default directory of the plain passwords, for distribution to the clients."""


@dataclass(slots=True)
class Grants:
    """One user's NATS permissions: subjects it may publish to and subscribe to."""

    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)

    def add(self, *, publish: Iterable[str] = (), subscribe: Iterable[str] = ()) -> None:
        """Add subjects not granted yet, keeping the order of first appearance."""
        self.publish += [s for s in dict.fromkeys(publish) if s not in self.publish]
        self.subscribe += [s for s in dict.fromkeys(subscribe) if s not in self.subscribe]


def subjects(topic_filter: str) -> list[str]:
    """The NATS subjects the MQTT gateway uses for an MQTT topic filter.

    ``a/b.c/+/#`` -> ``a.b//c.*`` and ``a.b//c.*.>``: a trailing ``#`` also matches the
    level above it, which the gateway subscribes separately, so both must be granted.
    """
    levels = topic_filter.split("/")
    if any(not level for level in levels) or topic_filter.startswith("$"):
        msg = f"{topic_filter!r}: polca's topics have no blank level and no leading $"
        raise TopologyError(msg)
    converted = [
        "*" if level == "+" else ">" if level == "#" else level.replace(".", "//")
        for level in levels
    ]
    if converted[-1] == ">":
        parent = converted[:-1]
        return [".".join(parent), ".".join(converted)] if parent else [">"]
    return [".".join(converted)]


def acl_grants(acl_text: str) -> dict[str, Grants]:
    """The grants of a strict Mosquitto ACL (``user`` sections of ``topic`` lines) as NATS
    subjects, by user; ``read`` -> subscribe, ``write`` -> publish."""
    grants: dict[str, Grants] = {}
    user: str | None = None
    for number, line in enumerate(acl_text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "user" and len(words) == 2:
            user = words[1]
            grants.setdefault(user, Grants())
        elif words[0] == "topic" and len(words) == 3 and user is not None:
            access, topic_filter = words[1], words[2]
            converted = subjects(topic_filter)
            grants[user].add(
                publish=converted if access in ("write", "readwrite") else (),
                subscribe=converted if access in ("read", "readwrite") else (),
            )
        else:
            msg = f"line {number} of make-acl.py's ACL is not a user or topic line: {line!r}"
            raise TopologyError(msg)
    return grants


def _wide_reads(topology: Any, users: Any, simulated: Sequence[str]) -> dict[str, list[str]]:
    """The filters polca's clients subscribe to that are wider than their strict grants.

    Each mirrors polca's code (kept in step by tests/deploy/test_nats_roles.py): the
    viewer's are ``polca status``'s (polca/status.py, ``collect``), the scheduler's
    ``polca assign``'s lookup of a node (polca/assign/publish.py), a simulated CDU's
    ``polca cdu simulate --rack``'s (polca/cdu/cli.py, ``Topics.all_nodes``).
    """
    site = f"{topology.root}/{topology.site}"
    reads: dict[str, list[str]] = {
        users.viewer: [
            f"{site}/+/summary",
            f"{site}/+/control",
            f"{site}/+/+/control",
            f"{site}/+/+/+/status",
            f"{site}/+/+/+/state",
            f"{site}/aggregator/+/status",
        ],
        users.scheduler: [
            f"{site}/+/+/{node}/status"
            for row in topology.rows
            for rack in row.racks
            for node in rack.nodes
        ],
    }
    for loop in topology.loops:
        if loop.cdu in simulated:
            rows = dict.fromkeys(row for row, _rack in loop.racks)
            reads[loop.cdu] = [f"{site}/{row}/+/+/telemetry" for row in rows]
    return reads


def topology_grants(
    topology: Any, users: Any, *, source: str, simulated: Sequence[str] = ()
) -> dict[str, Grants]:
    """Every user's NATS grants for one aggregator's topology: make-acl.py's strict ACL,
    converted, plus the wider filters polca's clients subscribe to (``_wide_reads``)."""
    text: str = acl.acl_text(topology, users, source=source, simulated=simulated)
    grants = acl_grants(text)
    for user, filters in _wide_reads(topology, users, simulated).items():
        grants[user].add(subscribe=[s for f in filters for s in subjects(f)])
    return grants


def merge(parts: Iterable[Mapping[str, Grants]]) -> dict[str, Grants]:
    """Several aggregators' grants in one: a user named in several gets all of them."""
    merged: dict[str, Grants] = {}
    for part in parts:
        for user, grants in part.items():
            merged.setdefault(user, Grants()).add(
                publish=grants.publish, subscribe=grants.subscribe
            )
    return merged


_SERVICES = acl.ServiceUsers()
DEFAULT_USERS: tuple[str | None, str, str, str, str] = (
    None,
    _SERVICES.scheduler,
    _SERVICES.viewer,
    _SERVICES.site,
    _SERVICES.operator,
)
"""configs_grants's service users: the aggregator (None: each configuration's), the
scheduler, the viewer, the site controller and the operator (make-acl.py's defaults)."""


def configs_grants(
    configs: Sequence[Path],
    *,
    root: str | None = None,
    users: tuple[str | None, str, str, str, str] = DEFAULT_USERS,
    simulated: Sequence[str] = (),
) -> dict[str, Grants]:
    """The merged grants of one or more aggregator configurations.

    ``users`` are the aggregator (None: each configuration's ``mqtt.username``, else
    ``polca-aggregator``), scheduler, viewer, site controller and operator user names.
    Raises ``TopologyError`` for an unusable configuration, a node, CDU or meter user in
    two configurations, or a simulated CDU that no configuration has.
    """
    aggregator_user, *shared = users
    parts: list[dict[str, Grants]] = []
    used: set[str] = set()
    owners: dict[str, Path] = {}
    for config in configs:
        topology = acl.load_topology(config, root=root)
        aggregator = aggregator_user or topology.aggregator_user or acl.ServiceUsers().aggregator
        service_users = acl.ServiceUsers(aggregator, *shared)
        cdus = {loop.cdu for loop in topology.loops}
        chosen = [cdu for cdu in simulated if cdu in cdus]
        used.update(chosen)
        parts.append(topology_grants(topology, service_users, source=str(config), simulated=chosen))
        # Nodes, CDUs and meters belong to one configuration; the services may be shared.
        for name in set(acl.user_names(topology, service_users)) - {aggregator, *shared}:
            if name in owners:
                msg = f"user {name!r} is in {owners[name]} and in {config}"
                raise TopologyError(msg)
            owners[name] = config
    unknown = sorted(set(simulated) - used)
    if unknown:
        msg = f"--simulated-cdu names no CDU of the configurations: {', '.join(unknown)}"
        raise TopologyError(msg)
    return merge(parts)


def _permission(kind: str, subjects_: Sequence[str]) -> list[str]:
    """The ``publish`` or ``subscribe`` lines of one user, one subject a line."""
    # An empty allow list means "everything" to NATS: a user without grants is denied
    # everything instead.
    if not subjects_:
        return [f'        {kind}: {{deny: [">"]}}']
    return [
        f"        {kind}: {{allow: [",
        *(f"          {json.dumps(subject)}" for subject in subjects_),
        "        ]}",
    ]


def auth_text(grants: Mapping[str, Grants], passwords: Mapping[str, str], *, source: str) -> str:
    """auth.conf: one user per entry of ``grants``, MQTT connections only."""
    out = [
        f"# NATS users and permissions for polca, generated by make-auth.py from {source}.",
        "# Do not edit: change the configuration and run make-auth.py again. Each user may",
        "# publish and subscribe to exactly the subjects listed (MQTT topics as NATS subjects:",
        "# / -> ., . -> //, + -> *, # -> >); everything else is refused. Roles:",
        "# deploy/nats/README.md. Readable by the nats user only: the passwords are plain.",
        "authorization {",
        "  users = [",
    ]
    for user, grant in grants.items():
        out += [
            "    {",
            f"      user: {json.dumps(user)}",
            f"      password: {json.dumps(passwords[user])}",
            '      allowed_connection_types: ["MQTT"]',
            "      permissions: {",
            *_permission("publish", grant.publish),
            *_permission("subscribe", grant.subscribe),
            "      }",
            "    }",
        ]
    out += ["  ]", "}", ""]
    return "\n".join(out)


def passwords_in(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """Each user's password from ``directory/<user>.pass``, created (random, mode 600)
    when missing, so a second run keeps the passwords the clients already have."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    passwords: dict[str, str] = {}
    for name in names:
        path = directory / f"{name}.pass"
        text = path.read_text(encoding="utf-8").strip() if path.exists() else ""
        if not text:
            text = secrets.token_hex(16)
            _write(path, text + "\n", mode=0o600)
        passwords[name] = text.splitlines()[0]
    return passwords


def _write(path: Path, text: str, *, mode: int) -> None:
    """Write ``path`` through a temporary file, so a reload never reads half of it."""
    partial = path.with_name(f".{path.name}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    partial.chmod(mode)
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Command line: write auth.conf and the users' passwords; 0 on success."""
    parser = argparse.ArgumentParser(
        prog="make-auth.py",
        description="NATS users and permissions for polca from aggregator configurations.",
    )
    parser.add_argument(
        "config",
        type=Path,
        nargs="+",
        help="aggregator configuration (YAML or .json); several for several aggregators",
    )
    parser.add_argument("-o", "--output", type=Path, help="auth.conf to write (default: stdout)")
    parser.add_argument(
        "--secrets-dir",
        type=Path,
        default=SECRETS_DIR,
        help=f"where each user's password is kept, as <user>.pass (default: ./{SECRETS_DIR})",
    )
    parser.add_argument("--root", default=None, help="topic root (default: topic_root)")
    defaults = acl.ServiceUsers()
    parser.add_argument(
        "--aggregator-user",
        default=None,
        help=f"default: each configuration's mqtt.username, else {defaults.aggregator}",
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
        grants = configs_grants(
            args.config,
            root=args.root,
            users=(
                args.aggregator_user,
                args.scheduler_user,
                args.viewer_user,
                args.site_user,
                args.operator_user,
            ),
            simulated=args.simulated_cdu,
        )
    except TopologyError as exc:
        sys.stderr.write(f"make-auth.py: error: {exc}\n")
        return 2
    passwords = passwords_in(args.secrets_dir, grants)
    text = auth_text(grants, passwords, source=", ".join(str(c) for c in args.config))
    if args.output is None:
        sys.stdout.write(text)
    else:
        _write(args.output, text, mode=0o600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
