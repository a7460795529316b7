"""``polca budget``: what the power tree allows each domain and row, and an operator's limits.

::

    polca budget show [--json]                                  # the tree, each row's budget
    polca budget set DOMAIN --watts W [--until TIME] --reason TEXT
    polca budget clear DOMAIN [--reason TEXT]

``show`` reads the site controller's retained report (``{root}/{site}/powertree/state``:
each domain's capacity, feeds and their state, allocation, measured power, the operators'
limits) and the rows' retained budgets, and prints them as tables (or one JSON object).

``set`` lowers a domain for a window (maintenance, a generator, a grid event): it reads the
report first and refuses a domain the tree does not have or a value above what the
domain's feeds can carry now (a limit only lowers), then publishes a retained
``BudgetLimit`` on ``{root}/{site}/powertree/limit/{DOMAIN}`` (QoS 1) with who set it
(the broker user, or the login, at this host) and why, and waits for its own message to
come back: Mosquitto acknowledges a publish its ACL denies and drops it, so a message that
does not come back means this user lacks the operator role. ``--until`` is a time with its
zone (``2026-12-08T14:00Z``) or a span from now (``+90m``, ``+2h``, ``+30s``); without it
the limit holds until cleared. ``clear`` publishes a limit of no watts, so the last word on
the topic still says who cleared it and why. The site controller logs each one
(``domain_limit_set``, ``domain_limit_cleared``) and applies it at its next step.

Settings as every polca process reads them (``--config`` or ``POLCA_CONFIG``, ``POLCA_*``):
``mqtt`` (the operator's user in ``mqtt.username``, its password from
``mqtt.password_file``, ``POLCA_MQTT__PASSWORD`` or the ``mqtt_password`` credential),
``site`` and ``topic_root``. Exit codes (``polca.exits``): 0; 65 a domain the tree lacks
or a value above its capacity; 69 the broker unreachable, or no site report (no site
controller running); 77 the credentials refused or the limit not taken (ACL); 78 a
configuration or usage problem; each failure one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from polca.errors import ConfigError, PolcaError, SchemaError, TransportError
from polca.exits import (
    EX_CONFIG,
    EX_DATAERR,
    EX_FAILURE,
    EX_INTERRUPTED,
    EX_NOPERM,
    EX_UNAVAILABLE,
    one_shot_code,
)
from polca.settings import MqttSettings, OneShotSettings, load_one_shot_settings
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import InMessage, OutMessage
from polca.telemetry.oneshot import gather, next_message, one_shot_bus
from polca.telemetry.schema import Budget, BudgetLimit, SiteReport, decode, encode
from polca.telemetry.topics import Topics

__all__ = ["BudgetSettings", "add_parsers", "main"]

READ_WAIT_S = 1.0
"""How long ``show`` and ``set`` gather retained messages once subscribed."""
_SPAN = re.compile(r"^\+(\d+(?:\.\d+)?)([smhd])$")
_SPAN_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_WINDOW_S = 366 * 86400


class BudgetSettings(OneShotSettings):
    """Settings of ``polca budget`` (YAML via ``--config``, ``POLCA_*`` env)."""


class RefusedError(PolcaError):
    """The request does not fit the tree: no such domain, above its capacity (exit 65)."""


class NotTakenError(PolcaError):
    """The broker acknowledged the limit but never delivered it back (exit 77)."""


class NoReportError(PolcaError):
    """No site controller's report is retained (exit 69)."""


def add_parsers(sub: Any) -> None:
    """``polca budget show|set|clear``."""
    budget = sub.add_parser("budget", help="the power tree's budgets, and operators' limits")
    bsub = budget.add_subparsers(dest="budget_command", required=True)
    show = bsub.add_parser("show", help="each domain's capacity, feeds, allocation; each row's")
    _common(show)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    put = bsub.add_parser("set", help="limit a domain for a window, with a reason")
    _common(put)
    put.add_argument("domain", help="the domain (as the site file names it)")
    put.add_argument("--watts", required=True, help="the most the domain may carry")
    put.add_argument("--until", default=None, help="TIME with its zone, or +90m / +2h / +30s")
    put.add_argument("--reason", required=True, help="why (kept with the limit, audited)")
    clear = bsub.add_parser("clear", help="remove a domain's limit")
    _common(clear)
    clear.add_argument("domain", help="the domain (as the site file names it)")
    clear.add_argument("--reason", default="cleared", help="why (kept, audited)")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="settings (broker, site)")
    parser.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    parser.add_argument("--site", default=None, help="site name (default: settings, 'site')")
    parser.add_argument("--username", default=None, help="MQTT user (mqtt.username)")
    parser.add_argument("--password-file", type=Path, default=None, help="MQTT password file")
    parser.add_argument("--timeout", default="5", help="seconds for the broker (default 5)")


def main(args: argparse.Namespace) -> int:
    """Run ``polca budget ...``; the exit code (one line on stderr on failure)."""
    from polca import logs  # noqa: PLC0415

    logs.configure(level="error", stream=sys.stderr)
    try:
        settings = _settings(args)
        timeout_s = _seconds(args.timeout, "--timeout")
        if args.budget_command == "show":
            report = asyncio.run(show(settings, timeout_s=timeout_s))
            _print(report, as_json=args.json, out=sys.stdout)
            return 0
        order = _order(args, settings.mqtt)
        done = asyncio.run(publish_limit(settings, order, timeout_s=timeout_s))
    except RefusedError as exc:
        return _fail(args, exc, EX_DATAERR)
    except NotTakenError as exc:
        return _fail(args, exc, EX_NOPERM)
    except NoReportError as exc:
        return _fail(args, exc, EX_UNAVAILABLE)
    except ConfigError as exc:
        return _fail(args, exc, EX_CONFIG)
    except PolcaError as exc:
        return _fail(args, exc, one_shot_code(exc))
    except KeyboardInterrupt:
        return _fail(args, PolcaError("interrupted"), EX_INTERRUPTED)
    except Exception as exc:  # a bug: still one line, never a traceback
        return _fail(args, PolcaError(f"{type(exc).__name__}: {exc}"), EX_FAILURE)
    sys.stdout.write(json.dumps(done) + "\n")
    return 0


def _fail(args: argparse.Namespace, exc: BaseException, code: int) -> int:
    text = " ".join(str(exc).split()) or type(exc).__name__
    sys.stderr.write(f"polca budget {args.budget_command}: {text}\n")
    return code


def _settings(args: argparse.Namespace) -> BudgetSettings:
    return load_one_shot_settings(BudgetSettings, args)


def _seconds(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        msg = f"{what} must be a number of seconds above 0, got {text!r}"
        raise ConfigError(msg)
    return value


def until_ns(text: str, *, now_ns: int) -> int:
    """``--until``: a time with its zone, or ``+N[smhd]`` from now; Unix ns, in the future."""
    span = _SPAN.match(text.strip())
    if span is not None:
        window_s = float(span.group(1)) * _SPAN_S[span.group(2)]
    else:
        try:
            when = datetime.fromisoformat(text.strip())
        except ValueError:
            msg = f"--until {text!r}: give a time with its zone (2026-12-08T14:00Z) or +90m"
            raise ConfigError(msg) from None
        if when.tzinfo is None:
            msg = f"--until {text!r} has no time zone: add Z or +HH:MM"
            raise ConfigError(msg)
        window_s = when.timestamp() - now_ns / 1e9
    if not 0 < window_s <= _MAX_WINDOW_S:
        msg = f"--until {text!r} is not between now and a year from now"
        raise ConfigError(msg)
    return now_ns + round(window_s * 1e9)


def _order(args: argparse.Namespace, mqtt: MqttSettings) -> BudgetLimit:
    now_ns = time.time_ns()
    watts: float | None = None
    ends: int | None = None
    if args.budget_command == "set":
        try:
            watts = float(args.watts)
        except ValueError:
            watts = math.nan
        if not (math.isfinite(watts) and watts >= 0):
            msg = f"--watts must be a number of watts, 0 or more, got {args.watts!r}"
            raise ConfigError(msg)
        ends = until_ns(args.until, now_ns=now_ns) if args.until is not None else None
    reason = " ".join(str(args.reason).split())
    if not reason:
        msg = "--reason must say why (it is kept with the limit)"
        raise ConfigError(msg)
    user = mqtt.username or getpass.getuser()
    by = f"{user}@{socket.gethostname().split('.')[0]}"[:128]
    try:
        return BudgetLimit(
            ts_ns=now_ns,
            domain=args.domain,
            watts=watts,
            until_ns=ends,
            reason=reason[:512],
            by=by,
        )
    except ValueError as exc:
        msg = f"the limit cannot be sent: {str(exc).splitlines()[-1].strip()}"
        raise ConfigError(msg) from None


def _connection(
    settings: BudgetSettings, filters: Sequence[str], timeout_s: float
) -> AbstractAsyncContextManager[MqttBus]:
    """This command's one connection, subscribed to ``filters``."""
    return one_shot_bus(
        settings.mqtt,
        client_id=f"polca-budget-{os.getpid()}",
        subscriptions=[(f, 1) for f in filters],
        timeout_s=timeout_s,
    )


def _snapshot(topics: Topics, site: str, messages: Sequence[InMessage]) -> dict[str, Any]:
    """The report and the rows' budgets among ``messages`` (unreadable ones counted)."""
    report: SiteReport | None = None
    budgets: dict[str, Budget] = {}
    rejected = 0
    for message in messages:
        if not message.payload:
            continue
        try:
            if message.topic == topics.site_report(site):
                report = decode(message.payload, SiteReport)
            else:
                budget = decode(message.payload, Budget)
                if message.topic == topics.budget(site, budget.row):
                    budgets[budget.row] = budget
                else:
                    rejected += 1
        except SchemaError:
            rejected += 1
    if report is None:
        msg = (
            f"no site report on {topics.site_report(site)} within {READ_WAIT_S:g} s: is "
            "polca site run leading for this site?"
        )
        raise NoReportError(msg)
    return {"report": report, "budgets": budgets, "rejected": rejected}


async def show(settings: BudgetSettings, *, timeout_s: float) -> dict[str, Any]:
    """The site's report and its rows' budgets, as retained on the broker."""
    topics, site = Topics(settings.topic_root), settings.site
    filters = [topics.site_report(site), topics.budget(site, "+")]
    async with _connection(settings, filters, timeout_s) as bus:
        return _snapshot(topics, site, await gather(bus, READ_WAIT_S))


async def publish_limit(
    settings: BudgetSettings, order: BudgetLimit, *, timeout_s: float
) -> dict[str, Any]:
    """Check ``order`` against the site's report, publish it, see it back."""
    topics, site = Topics(settings.topic_root), settings.site
    topic = topics.budget_limit(site, order.domain)
    async with _connection(settings, [topics.site_report(site), topic], timeout_s) as bus:
        report = _snapshot(topics, site, await gather(bus, READ_WAIT_S))["report"]
        domains = {d.name: d for d in report.domains}
        domain = domains.get(order.domain)
        if domain is None:
            names = ", ".join(sorted(domains)[:12])
            msg = f"the site has no domain {order.domain!r} (it has: {names})"
            raise RefusedError(msg)
        if order.watts is not None and order.watts > domain.unlimited_w:
            msg = (
                f"{order.watts:.0f} W is above what {order.domain} can carry now "
                f"({domain.unlimited_w:.0f} W): a limit only lowers a domain"
            )
            raise RefusedError(msg)
        payload = encode(order)
        async with asyncio.timeout(timeout_s):
            sent = await bus.publish(OutMessage(topic, payload, qos=1, retain=True))
        if not sent:
            msg = f"the MQTT broker did not acknowledge the limit on {topic}"
            raise TransportError(msg)
        until = asyncio.get_running_loop().time() + max(timeout_s, 1.0)
        while (message := await next_message(bus, until)) is not None:
            if message.topic == topic and message.payload == payload:
                return {
                    "domain": order.domain,
                    "watts": order.watts,
                    "until_ns": order.until_ns,
                    "by": order.by,
                    "reason": order.reason,
                    "topic": topic,
                }
    user = settings.mqtt.username or "anonymous"
    msg = (
        f"the broker did not take the limit on {topic} (it never came back): {user} "
        "needs the operator role (deploy/mosquitto/acl: polca-operator)"
    )
    raise NotTakenError(msg)


def _kw(watts: float | None) -> str:
    return "-" if watts is None else f"{watts / 1000:.1f}"


def _print(snapshot: dict[str, Any], *, as_json: bool, out: TextIO) -> None:
    report: SiteReport = snapshot["report"]
    budgets: dict[str, Budget] = snapshot["budgets"]
    if as_json:
        data = {
            "report": report.model_dump(mode="json"),
            "budgets": {row: b.model_dump(mode="json") for row, b in sorted(budgets.items())},
            "rejected": snapshot["rejected"],
        }
        out.write(json.dumps(data, indent=2) + "\n")
        return
    role = "leading" if report.publishing else "standby"
    out.write(f"site controller {report.issuer} (term {report.term}, {role})\n")
    out.write(
        f"{'DOMAIN':<24}{'KIND':<12}{'RATING':>9}{'CAP kW':>9}{'BUDGET':>9}{'POWER':>9}  FEEDS\n"
    )
    for d in report.domains:
        feeds = ", ".join(
            f"{f.name} {'up' if f.up else 'DOWN'}" + (f" ({f.equipment})" if not f.up else "")
            for f in d.feeds
        )
        name = ("  " if d.parent else "") + d.name
        out.write(
            f"{name:<24}{d.kind:<12}{_kw(d.rating_w):>9}{_kw(d.capacity_w):>9}"
            f"{_kw(d.budget_w):>9}{_kw(d.measured_w):>9}  {feeds or '-'}"
            f"{'  ON BATTERY' if d.on_battery else ''}\n"
        )
        if d.limit_w is not None:
            until = (
                datetime.fromtimestamp(d.limit_until_ns / 1e9)
                .astimezone()
                .isoformat("T", "minutes")
                if d.limit_until_ns is not None
                else "cleared"
            )
            out.write(
                f"    limit {_kw(d.limit_w)} kW until {until} by {d.limit_by}: {d.limit_reason}\n"
            )
    out.write(
        f"\n{'ROW':<24}{'RATING':>9}{'BUDGET':>9}{'LEASED':>9}{'POWER':>9}  ORIGIN / LIMITED BY\n"
    )
    for r in report.rows:
        leased = budgets.get(r.name)
        limited = r.limited_by or "-"
        out.write(
            f"{r.name:<24}{_kw(r.rating_w):>9}{_kw(r.budget_w):>9}"
            f"{_kw(leased.budget_w if leased else None):>9}{_kw(r.measured_w):>9}  "
            f"{r.origin or '?'} / {limited}{'  (summary stale)' if r.stale else ''}\n"
        )
    if report.truncated:
        out.write("(the report was cut to fit the wire: see the site controller's metrics)\n")
