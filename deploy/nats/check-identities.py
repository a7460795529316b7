#!/usr/bin/env python3
"""Check that every MQTT client of a NATS node holds a client id of its own user.

Why this exists: NATS server's MQTT gateway keys sessions by client id within an account,
whatever the user: a client that connects with a client id already in use, on any node of
the cluster, closes the other connection ("Closing because a remote connection has started
with the same client ID"), so one node's credential can evict another node's agent and
keep it off the bus (README.md in this folder, "A client id is not bound to its user").
Mosquitto binds the two (``use_username_as_clientid``); NATS has no such option, and the
full fix, an auth callout that refuses the CONNECT, is not built. This script is the
compensating check: it reads a node's monitoring endpoint (``/varz`` for the server's
name, ``/connz?auth=true`` page by page for its connections) and, for every MQTT
connection, compares the client id with the authenticated user (``mqtt_client`` and
``authorized_user`` of each connection, as nats-server 2.15 reports them).

polca's client ids name their owner (daemon/polca, ``client_id=``):

- ``polca-agent-<node>``: the agent of node <node>, whose user is the node's name;
- ``polca-cdu-<cdu>``: a CDU source, whose user is the CDU's name;
- ``polca-aggregator-<instance>`` and ``polca-aggregator-<instance>-<connection>``: the
  aggregator user(s) (``--aggregator-user``, default ``polca-aggregator``);
- ``polca-assign-...``: the scheduler (``polca assign``), ``polca-status-...``: the viewer
  (``polca status``), ``polca-meter-...``: a meter (``meter-<row>``);
- ``polca-site-<site>-<instance>``: the site controller (``polca site run``, user
  ``polca-site``), ``polca-budget-...``: the operator (``polca budget``, user
  ``polca-operator``).

A connection holding one of them under another user is a mismatch, whoever the user is: a
node's id held by a service user, a test user or nobody is one too. Any other client id
(a configured ``mqtt.client_id``, an operator's tool) names no owner and is counted as
unchecked. The check sees who holds each id when it runs: a takeover between two runs, or
one that the evicted agent took back before the run, is not seen.

The answers are treated as hostile: each is read up to a bound (64 MiB), parsed as strict
JSON (no duplicate keys, no NaN) and type-checked field by field; an answer that is not
what NATS sends is an error, as is a server with more connections than
``--max-connections``. It runs on a broker host without polca installed, in a sandbox
(``nats-identity-check.service``): the standard library only, and it writes nothing but the
optional ``--textfile`` (Prometheus text format, for node_exporter's textfile collector,
written through a temporary file and a rename).

Exit status: 0 every checked client holds its own id; 1 mismatches found (also when a
server could not be read: the mismatches found are certain); 2 a usage error; 3 a
monitoring endpoint unreachable or its answer malformed, or the textfile not written. Each
problem is one line on stderr, never a traceback.

    check-identities.py --monitor http://127.0.0.1:8222 \
        --textfile /run/polca-nats-identity/nats-identity.prom
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

MONITOR = "http://127.0.0.1:8222"
"""The default monitoring endpoint: nats-server.conf's ``http`` listener."""
PAGE_LIMIT = 1024
"""Connections asked for per ``/connz`` page (the server's own default page size)."""
MAX_RESPONSE_BYTES = 64 * 2**20
"""Bound on one answer's size; a larger one is an error."""
MAX_CONNECTIONS = 65536
"""Default bound on one server's connections (nats-server.conf allows 2048)."""
TIMEOUT_S = 5.0
"""Default bound on each HTTP request's connect and on each of its reads (a server that
trickles its answer is bounded by the unit's TimeoutStartSec)."""
SHOWN_CHARS = 200
"""Longest client id or user name printed; the rest is cut (MQTT allows 65535 bytes)."""

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_UNREADABLE = 0, 1, 2, 3

NAMED_PREFIXES = ("polca-agent-", "polca-cdu-")
"""Client ids whose rest is the owner's user name (a node's agent, a CDU source)."""

_T = TypeVar("_T")


class CheckError(Exception):
    """A monitoring endpoint unreachable, or an answer that is not what NATS sends."""


@dataclass(frozen=True, slots=True)
class Users:
    """The service users polca's client ids belong to (make-auth.py's defaults)."""

    aggregators: frozenset[str] = frozenset({"polca-aggregator"})
    """Every aggregator's user (its configuration's ``mqtt.username``)."""
    scheduler: str = "polca-scheduler"
    viewer: str = "polca-viewer"
    meter_prefix: str = "meter-"
    """A meter's user is ``meter-<row>`` (its client id names the site, not the row)."""
    site: str = "polca-site"
    """The site controller's user (its instances share it)."""
    operator: str = "polca-operator"
    """``polca budget``'s user."""


@dataclass(frozen=True, slots=True)
class Owner:
    """Who may hold a client id: one of ``names``, or a user starting with ``prefix``."""

    names: frozenset[str] = frozenset()
    prefix: str | None = None

    def allows(self, user: str | None) -> bool:
        """Whether ``user`` (None: no authenticated user) may hold the client id."""
        if user is None:
            return False
        return user in self.names or (self.prefix is not None and user.startswith(self.prefix))


@dataclass(frozen=True, slots=True)
class Client:
    """One MQTT connection of one server, as ``/connz`` reports it."""

    server: str
    cid: int
    address: str
    client_id: str
    user: str | None
    """``authorized_user``; None when the connection has none (anonymous)."""


@dataclass(slots=True)
class Report:
    """What one check found."""

    servers: int = 0
    checked: int = 0
    unchecked: int = 0
    mismatches: list[Client] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """One line per monitoring endpoint that could not be read."""


def owner(client_id: str, users: Users) -> Owner | None:
    """Who may hold ``client_id``; None for an id that names no owner (unchecked)."""
    for prefix in NAMED_PREFIXES:
        if client_id.startswith(prefix):
            return Owner(names=frozenset({client_id.removeprefix(prefix)}))
    if client_id.startswith("polca-aggregator-"):
        return Owner(names=users.aggregators)
    if client_id.startswith("polca-assign-"):
        return Owner(names=frozenset({users.scheduler}))
    if client_id.startswith("polca-status-"):
        return Owner(names=frozenset({users.viewer}))
    if client_id.startswith("polca-meter-"):
        return Owner(prefix=users.meter_prefix)
    if client_id.startswith("polca-site-"):
        return Owner(names=frozenset({users.site}))
    if client_id.startswith("polca-budget-"):
        return Owner(names=frozenset({users.operator}))
    return None


# --- Reading the monitoring endpoint ---------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A monitoring endpoint never redirects: a redirect is an error, not followed."""

    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None


# No proxy (the endpoint is the host's own) and no redirect.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())

Fetch = Callable[[str], bytes]
"""GET a URL, its body (at most ``MAX_RESPONSE_BYTES``); raises CheckError."""


def http_get(
    url: str, *, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_RESPONSE_BYTES
) -> bytes:
    """The body of a 200 answer to GET ``url``; CheckError for anything else."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        msg = f"{url}: not an http:// or https:// URL"
        raise CheckError(msg)
    request = urllib.request.Request(url, headers={"Accept": "application/json"})  # noqa: S310
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            status = response.status
            body: bytes = response.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        exc.close()
        msg = f"{url}: HTTP {exc.code} {exc.reason}"
        raise CheckError(msg) from exc
    except urllib.error.URLError as exc:
        msg = f"{url}: unreachable: {exc.reason}"
        raise CheckError(msg) from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:
        msg = f"{url}: unreachable: {type(exc).__name__}: {exc}"
        raise CheckError(msg) from exc
    if status != 200:
        msg = f"{url}: HTTP {status}, not 200"
        raise CheckError(msg)
    if len(body) > max_bytes:
        msg = f"{url}: answer larger than {max_bytes} bytes"
        raise CheckError(msg)
    return body


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)
    if len(result) != len(pairs):
        msg = "duplicate key in an object"
        raise ValueError(msg)
    return result


def _no_constant(name: str) -> object:
    msg = f"{name} is not JSON"
    raise ValueError(msg)


def parse_json(body: bytes, *, where: str) -> object:
    """Strict JSON: UTF-8, no duplicate keys, no NaN or Infinity; CheckError otherwise."""
    try:
        parsed: object = json.loads(
            body.decode("utf-8"), object_pairs_hook=_unique, parse_constant=_no_constant
        )
    except (ValueError, RecursionError) as exc:
        msg = f"{where}: not a JSON answer: {exc}"
        raise CheckError(msg) from exc
    return parsed


def _get(obj: Mapping[str, object], key: str, kind: type[_T], where: str) -> _T:
    """``obj[key]``, which must be there and of type ``kind`` (a bool is no int)."""
    if key not in obj:
        msg = f"{where}: no {key!r}"
        raise CheckError(msg)
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        msg = f"{where}: {key!r} is {type(value).__name__}, not {kind.__name__}"
        raise CheckError(msg)
    return value


def _optional(obj: Mapping[str, object], key: str, kind: type[_T], where: str) -> _T | None:
    return _get(obj, key, kind, where) if key in obj else None


def _count(obj: Mapping[str, object], key: str, where: str) -> int:
    value = _get(obj, key, int, where)
    if value < 0:
        msg = f"{where}: {key!r} is negative"
        raise CheckError(msg)
    return value


def _object(value: object, where: str) -> dict[str, object]:
    if not isinstance(value, dict):
        msg = f"{where}: {type(value).__name__}, not a JSON object"
        raise CheckError(msg)
    return value


def server_name(base: str, fetch: Fetch) -> str:
    """The server's ``server_name`` (``/varz``)."""
    url = f"{base}/varz"
    name = _get(_object(parse_json(fetch(url), where=url), url), "server_name", str, url)
    if not name:
        msg = f"{url}: empty 'server_name'"
        raise CheckError(msg)
    return name


def _client(raw: object, *, server: str, where: str) -> tuple[int, Client | None]:
    """A connection's id, and the connection if it is an MQTT one (it has ``mqtt_client``)."""
    conn = _object(raw, where)
    cid = _count(conn, "cid", where)
    where = f"{where}, cid {cid}"
    client_id = _optional(conn, "mqtt_client", str, where)
    if client_id is None:
        return cid, None
    ip = _get(conn, "ip", str, where)
    port = _count(conn, "port", where)
    address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    user = _optional(conn, "authorized_user", str, where) or None
    return cid, Client(server, cid, address, client_id, user)


def server_clients(
    base: str,
    fetch: Fetch,
    *,
    page_limit: int = PAGE_LIMIT,
    max_connections: int = MAX_CONNECTIONS,
) -> tuple[str, list[Client]]:
    """The server's name and its MQTT connections, read ``page_limit`` at a time.

    A connection that closes while the pages are read can shift the later ones and be
    missed (the next run sees it); one read twice is kept once (by ``cid``).
    """
    server = server_name(base, fetch)
    seen: dict[int, Client | None] = {}
    offset = 0
    for _page in range(max_connections // page_limit + 2):
        url = f"{base}/connz?auth=true&limit={page_limit}&offset={offset}"
        page = _object(parse_json(fetch(url), where=url), url)
        total = _count(page, "total", url)
        if _count(page, "offset", url) != offset:
            msg = f"{url}: answered another offset (paging not honoured)"
            raise CheckError(msg)
        if total > max_connections:
            msg = f"{url}: {total} connections, more than --max-connections {max_connections}"
            raise CheckError(msg)
        connections = _get(page, "connections", list, url)
        if len(connections) > page_limit:
            msg = f"{url}: {len(connections)} connections on a page of {page_limit}"
            raise CheckError(msg)
        for index, raw in enumerate(connections):
            cid, client = _client(raw, server=server, where=f"{url}, connection {index}")
            seen.setdefault(cid, client)
        if len(seen) > max_connections:
            msg = f"{url}: more than --max-connections {max_connections} connections"
            raise CheckError(msg)
        offset += len(connections)
        if not connections or offset >= total:
            return server, [client for client in seen.values() if client is not None]
    msg = f"{base}/connz: more pages than {max_connections} connections need"
    raise CheckError(msg)


# --- The check -------------------------------------------------------------------------


def check(
    bases: Sequence[str],
    users: Users,
    *,
    fetch: Fetch,
    page_limit: int = PAGE_LIMIT,
    max_connections: int = MAX_CONNECTIONS,
) -> Report:
    """Every server's MQTT connections, each client id compared with its user."""
    report = Report()
    for base in bases:
        try:
            _, clients = server_clients(
                base, fetch, page_limit=page_limit, max_connections=max_connections
            )
        except CheckError as exc:
            report.failures.append(str(exc))
            continue
        report.servers += 1
        for client in clients:
            allowed = owner(client.client_id, users)
            if allowed is None:
                report.unchecked += 1
                continue
            report.checked += 1
            if not allowed.allows(client.user):
                report.mismatches.append(client)
    return report


def shown(text: str) -> str:
    """``text`` safe for one log line: control characters escaped, at most SHOWN_CHARS."""
    cut = text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else "")
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in cut)


def mismatch_line(client: Client) -> str:
    """``client id X held by user Y (server S, ip:port)``."""
    holder = f"user {shown(client.user)}" if client.user is not None else "no user"
    return (
        f"client id {shown(client.client_id)} held by {holder} "
        f"(server {shown(client.server)}, {shown(client.address)})"
    )


def summary_line(report: Report, *, asked: int) -> str:
    """One line: the mismatches, the clients checked and unchecked, unreadable servers."""
    clients = report.checked + report.unchecked
    line = (
        f"{len(report.mismatches)} client id mismatch(es) among {clients} MQTT client(s) "
        f"on {report.servers} server(s): {report.checked} checked, {report.unchecked} unchecked"
    )
    if report.failures:
        line += f"; {len(report.failures)} of {asked} server(s) not read"
    return line


def textfile_text(report: Report, *, now_s: float) -> str:
    """The report in Prometheus text format, for node_exporter's textfile collector."""
    metrics: list[tuple[str, str, float | int]] = [
        (
            "polca_nats_client_id_mismatches",
            "MQTT connections holding a polca client id of another user.",
            len(report.mismatches),
        ),
        (
            "polca_nats_identity_checked_clients",
            "MQTT connections whose client id names its owner.",
            report.checked,
        ),
        (
            "polca_nats_identity_unchecked_clients",
            "MQTT connections whose client id names no owner.",
            report.unchecked,
        ),
        (
            "polca_nats_identity_check_success",
            "1 when every monitoring endpoint was read, else 0.",
            0 if report.failures else 1,
        ),
        (
            "polca_nats_identity_check_timestamp_seconds",
            "When the check ran (Unix time).",
            round(now_s, 3),
        ),
    ]
    lines: list[str] = []
    for name, help_text, value in metrics:
        lines += [
            f"# HELP {name} {help_text} (deploy/nats/check-identities.py)",
            f"# TYPE {name} gauge",
            f"{name} {value}",
        ]
    return "\n".join([*lines, ""])


def write_textfile(path: Path, text: str) -> None:
    """Write ``path`` (mode 644) through a temporary file in its directory and a rename,
    so node_exporter never reads half of it (it reads ``*.prom`` files only)."""
    descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        Path(partial).chmod(0o644)
        Path(partial).replace(path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


# --- Command line ----------------------------------------------------------------------


def monitor_url(value: str) -> str:
    """An ``http(s)://host[:port][/base path]`` URL, without a trailing slash."""
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        msg = f"{value!r} is not an http:// or https:// URL"
        raise argparse.ArgumentTypeError(msg)
    if parsed.query or parsed.fragment:
        msg = f"{value!r}: give the endpoint's base URL, without a query"
        raise argparse.ArgumentTypeError(msg)
    return value.rstrip("/")


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not number > 0:  # also NaN
        msg = f"{value!r} is not a positive number"
        raise argparse.ArgumentTypeError(msg)
    return number


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if number <= 0:
        msg = f"{value!r} is not a positive integer"
        raise argparse.ArgumentTypeError(msg)
    return number


def parser() -> argparse.ArgumentParser:
    """The command line (also read by tests/deploy/test_nats_identity.py)."""
    defaults = Users()
    result = argparse.ArgumentParser(
        prog="check-identities.py",
        description="Report MQTT clients of a NATS cluster that hold another user's client id.",
    )
    result.add_argument(
        "--monitor",
        action="append",
        type=monitor_url,
        metavar="URL",
        help=f"a node's monitoring endpoint (repeatable; default: {MONITOR})",
    )
    result.add_argument(
        "--textfile",
        type=Path,
        help="also write the result here in Prometheus text format (node_exporter)",
    )
    result.add_argument(
        "--aggregator-user",
        action="append",
        metavar="USER",
        help=f"a user polca-aggregator-* ids belong to (repeatable; default: "
        f"{', '.join(sorted(defaults.aggregators))})",
    )
    result.add_argument("--scheduler-user", default=defaults.scheduler)
    result.add_argument("--viewer-user", default=defaults.viewer)
    result.add_argument("--site-user", default=defaults.site)
    result.add_argument("--operator-user", default=defaults.operator)
    result.add_argument(
        "--timeout",
        type=_positive_float,
        default=TIMEOUT_S,
        metavar="SECONDS",
        help=f"bound on each HTTP request (default: {TIMEOUT_S:g})",
    )
    result.add_argument(
        "--max-connections",
        type=_positive_int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help=f"refuse a server with more connections (default: {MAX_CONNECTIONS})",
    )
    return result


def _error(message: str) -> None:
    sys.stderr.write(f"check-identities.py: error: {shown(message)}\n")


def main(argv: list[str] | None = None) -> int:
    """Command line: check every endpoint; the exit status says what was found."""
    args = parser().parse_args(argv)
    bases: list[str] = list(dict.fromkeys(args.monitor or [MONITOR]))
    aggregators: Iterable[str] = args.aggregator_user or Users().aggregators
    users = Users(
        frozenset(aggregators),
        args.scheduler_user,
        args.viewer_user,
        site=args.site_user,
        operator=args.operator_user,
    )
    timeout_s: float = args.timeout

    def fetch(url: str) -> bytes:
        return http_get(url, timeout_s=timeout_s)

    now_s = time.time()
    report = check(bases, users, fetch=fetch, max_connections=args.max_connections)
    for client in report.mismatches:
        sys.stdout.write(mismatch_line(client) + "\n")
    sys.stdout.write(summary_line(report, asked=len(bases)) + "\n")
    for failure in report.failures:
        _error(failure)
    status = EXIT_MISMATCH if report.mismatches else EXIT_UNREADABLE if report.failures else EXIT_OK
    if args.textfile is not None:
        try:
            write_textfile(args.textfile, textfile_text(report, now_s=now_s))
        except OSError as exc:
            _error(f"textfile {args.textfile} not written: {exc}")
            return status or EXIT_UNREADABLE
    return status


if __name__ == "__main__":
    sys.exit(main())
