"""``polca assign``: a batch scheduler's hook to set, change or clear a node's GPU classes.

::

    polca assign --node N --gpu 0 --gpu GPU-... --class high   # set these GPUs' class
    polca assign --node N --gpu 0 --clear                        # remove these GPUs' entries
    polca assign --node N --gpu 0 --class high --clear           # these GPUs only, the rest removed
    polca assign --node N --clear                                # clear the node's whole assignment

The assignment is one retained message per node, ``{root}/{site}/{row}/{rack}/{node}/assign``
(QoS 1), holding the node's whole map (``docs/mqtt.md``). A scheduler knows the node's
name only, so the command finds the row and rack in the node's retained ``status``
(``{root}/{site}/+/+/{node}/status``, read as ``polca status`` reads retained state; the
online one, then the newest, if the node left statuses in several racks) unless ``--row``
and ``--rack`` are given. It then reads the retained assignment, changes the named GPUs,
and publishes the whole map retained with ``seq`` one above the highest it has seen.
Clearing the whole assignment publishes an empty retained payload, which removes the
retained message (the agent then has no runtime assignment; ``seq`` starts again).

Two writers at once (two jobs starting on one node). Read, change and publish is not
atomic: MQTT has no compare-and-set, so two commands that read the same map and publish
one after the other would lose the first one's change. The command bounds this risk by
watching the topic from before its read until its own message comes back from the
broker (the subscription stays open, and the broker delivers the messages of one topic in
the order it took them): a message from anyone else arriving between its read and the
echo of its own publish means its publish may have overwritten a change it never saw, so
it applies its change again on top of that message and publishes once more (at most
``ATTEMPTS`` publishes; then it exits 69 saying so). The writer whose message the broker
took first sees no foreign message before its echo and is done; the later one re-merges.
What is left: a writer that dies between its publish and the echo leaves its change
unverified, and the GPUs of one job are expected to be named by that job only (two
writers changing the same GPU: the later one wins, as it should).

The echo is also the read-back that catches a refused publish: Mosquitto acknowledges a
publish its ACL denies and drops it, so a message that does not come back within the
timeout exits 77. The scheduler's user must therefore both write and read the ``assign``
topics (``deploy/mosquitto/acl``, ``polca-scheduler``); without read access it would also
publish maps built on an empty one.

Settings are read as every polca process reads them (``--config`` or ``POLCA_CONFIG``,
``POLCA_*``): ``mqtt`` (the scheduler's user in ``mqtt.username``, its password from
``mqtt.password_file``, ``POLCA_MQTT__PASSWORD`` or the ``mqtt_password`` credential),
``site`` and ``topic_root``. A class is checked only against the wire's name pattern: the
agent refuses a class its policy lacks, and logs it.

Output: one JSON line, ``{"node", "topic", "classes", "seq"}``: the map now retained and
its ``seq`` (``classes`` empty and ``seq`` null after clearing the whole assignment). Exit
codes (``polca.exits``): 0; 69 the broker unreachable, the node's status not found within
``--timeout``, or the map still changing under it after ``ATTEMPTS`` publishes; 77 the
credentials refused or the publish not taken (ACL); 78 a configuration or usage problem;
each failure one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from polca import aiokit
from polca.assign.filesource import gpu_key, is_class_name
from polca.errors import ConfigError, FatalError, PolcaError, SchemaError, TransportError
from polca.exits import (
    EX_CONFIG,
    EX_FAILURE,
    EX_INTERRUPTED,
    EX_NOPERM,
    EX_UNAVAILABLE,
    one_shot_code,
)
from polca.settings import (
    TOPIC_SEGMENT,
    MqttSettings,
    OneShotSettings,
    load_one_shot_settings,
)
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import OutMessage
from polca.telemetry.oneshot import next_message
from polca.telemetry.schema import MAX_PAYLOAD_BYTES, Assignment, Status, decode, encode
from polca.telemetry.topics import NodeAddress, Topics

__all__ = [
    "ATTEMPTS",
    "AssignSettings",
    "Change",
    "ConflictError",
    "NodeNotFoundError",
    "NotTakenError",
    "Outcome",
    "assign",
    "run",
]

ATTEMPTS = 3
"""Publishes at most per command: the first, and a re-merge after each lost update."""
SETTLE_S = 0.2
"""After the first retained status, how long more statuses of the node are collected."""
READ_WAIT_S = 1.0
"""Longest wait for the retained assignment when nothing marks the end of the retained
messages (``--row``/``--rack`` given for a node without a status)."""
ECHO_MIN_S = 1.0
"""The echo of a publish is awaited at least this long, whatever is left of ``--timeout``."""

_SEGMENT = re.compile(TOPIC_SEGMENT)


class AssignSettings(OneShotSettings):
    """Settings of ``polca assign`` (YAML via ``--config``, ``POLCA_*`` env)."""


class NodeNotFoundError(PolcaError):
    """No retained status names the node: its row and rack are unknown (exit 69)."""


class NotTakenError(PolcaError):
    """The broker acknowledged the publish but never delivered it back (exit 77)."""


class ConflictError(PolcaError):
    """Other writers changed the map between every read and publish (exit 69)."""


@dataclass(frozen=True, slots=True)
class Change:
    """What the command changes: these GPUs get ``cls`` (None: their entries go). With
    ``clear``, a class also drops every other entry, and no GPU named clears them all."""

    gpus: tuple[str, ...]
    cls: str | None
    clear: bool

    def apply(self, current: Mapping[str, str]) -> dict[str, str] | None:
        """The map after the change; None to clear the whole assignment."""
        if self.clear and not self.gpus:
            return None
        classes = {} if self.clear and self.cls is not None else dict(current)
        for gpu in self.gpus:
            if self.cls is None:
                classes.pop(gpu, None)
            else:
                classes[gpu] = self.cls
        return classes


@dataclass(frozen=True, slots=True)
class Outcome:
    """The map now retained on ``topic`` (and its ``seq``; None: no retained message)."""

    node: str
    topic: str
    classes: Mapping[str, str]
    seq: int | None

    def as_json(self) -> str:
        """The one line the command prints."""
        return json.dumps(
            {"node": self.node, "topic": self.topic, "classes": dict(self.classes), "seq": self.seq}
        )


def run(args: argparse.Namespace) -> int:
    """Run ``polca assign``; returns the exit code (the one line on stderr on failure)."""
    from polca import logs  # noqa: PLC0415

    logs.configure(level="error", stream=sys.stderr)  # stdout carries the one JSON line
    try:
        request = _request(args)
        settings = _settings(args)
    except FatalError as exc:
        return _fail(exc, EX_CONFIG)
    where = (args.row, args.rack) if args.row is not None else None
    try:
        outcome = asyncio.run(
            assign(
                settings.mqtt,
                topics=Topics(settings.topic_root),
                site=settings.site,
                node=request.node,
                change=request.change,
                where=where,
                timeout_s=request.timeout_s,
            )
        )
    except NotTakenError as exc:
        return _fail(exc, EX_NOPERM)
    except (NodeNotFoundError, ConflictError) as exc:
        return _fail(exc, EX_UNAVAILABLE)
    except PolcaError as exc:
        return _fail(exc, one_shot_code(exc))
    except KeyboardInterrupt:
        return _fail(PolcaError("interrupted"), EX_INTERRUPTED)
    except Exception as exc:  # a bug: still one line, never a traceback
        return _fail(PolcaError(f"{type(exc).__name__}: {exc}"), EX_FAILURE)
    sys.stdout.write(outcome.as_json() + "\n")
    return 0


def _fail(exc: BaseException, code: int) -> int:
    text = " ".join(str(exc).split()) or type(exc).__name__
    sys.stderr.write(f"polca assign: {text}\n")
    return code


@dataclass(frozen=True, slots=True)
class _Request:
    node: str
    change: Change
    timeout_s: float


def _request(args: argparse.Namespace) -> _Request:
    """The command line's request, checked; ``ConfigError`` says what is wrong."""
    if not args.node:
        msg = "--node is required (the node's name, as its agent publishes it)"
        raise ConfigError(msg)
    for name in ("node", "row", "rack", "site"):
        value = getattr(args, name)
        if value is not None and not _SEGMENT.fullmatch(value):
            msg = f"--{name} {value!r}: use letters, digits, '_', '.', '-'"
            raise ConfigError(msg)
    if (args.row is None) != (args.rack is None):
        msg = "--row and --rack go together (or neither: they are read from the status)"
        raise ConfigError(msg)
    gpus: list[str] = []
    for given in args.gpu:
        for part in given.split(","):
            key = gpu_key(part.strip())
            if key is None:
                msg = f"--gpu {part!r}: use a GPU index (0, 1, ...) or UUID (GPU-... or MIG-...)"
                raise ConfigError(msg)
            if key not in gpus:
                gpus.append(key)
    if args.cls is not None and not is_class_name(args.cls):
        msg = (
            f"--class {args.cls!r}: a class name has letters, digits, '_', '.', ':', '-' "
            "(at most 128)"
        )
        raise ConfigError(msg)
    if args.cls is None and not args.clear:
        msg = "say --class CLASS to set the GPUs' class, or --clear to remove entries"
        raise ConfigError(msg)
    if args.cls is not None and not gpus:
        msg = "--class needs at least one --gpu"
        raise ConfigError(msg)
    try:
        timeout_s = float(args.timeout)
    except ValueError:
        timeout_s = math.nan
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        msg = f"--timeout must be a number of seconds above 0, got {args.timeout!r}"
        raise ConfigError(msg)
    return _Request(args.node, Change(tuple(gpus), args.cls, bool(args.clear)), timeout_s)


def _settings(args: argparse.Namespace) -> AssignSettings:
    return load_one_shot_settings(AssignSettings, args)


async def assign(
    settings: MqttSettings,
    *,
    topics: Topics,
    site: str,
    node: str,
    change: Change,
    timeout_s: float,
    where: tuple[str, str] | None = None,
    clock_ns: Callable[[], int] = time.time_ns,
) -> Outcome:
    """Apply ``change`` to ``node``'s retained assignment and see it back from the broker.

    ``where`` is the node's (row, rack); None reads them from its retained status. Raises
    ``TransportAuthError`` (refused), ``TransportError`` (unreachable, silent),
    ``ConfigError`` (TLS files, a map too large), ``NodeNotFoundError``,
    ``NotTakenError`` and ``ConflictError`` (see the module's docstring).
    """
    address = NodeAddress(site, *where, node) if where is not None else None
    status_filter = topics.node_anywhere(site, node, "status")
    subscriptions = (
        [(status_filter, 1)]
        if address is None
        else [(topics.node(address, "assign"), 1), (topics.node(address, "status"), 1)]
    )
    bus = MqttBus(
        settings.one_shot(timeout_s),
        client_id=f"polca-assign-{os.getpid()}-{time.time_ns() % 10**6}",
        subscriptions=subscriptions,
        attempts=1,
    )
    exchange = _Exchange(bus, topics, settings, timeout_s=timeout_s, clock_ns=clock_ns)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bus.run())  # its error (refused, unreachable) ends the group
            try:
                outcome = await exchange.run(node, site, address, status_filter, change)
            finally:
                await bus.close(timeout_s=2.0)
    except* PolcaError as failed:  # the bus's error or ours, not a group of one
        raise failed.exceptions[0]  # noqa: B904 - the first failure is the command's
    return outcome


class _Exchange:
    """One command's conversation with the broker, over one connection."""

    def __init__(
        self,
        bus: MqttBus,
        topics: Topics,
        settings: MqttSettings,
        *,
        timeout_s: float,
        clock_ns: Callable[[], int],
    ) -> None:
        self._bus = bus
        self._topics = topics
        self._settings = settings
        self._timeout_s = timeout_s
        self._clock_ns = clock_ns
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + timeout_s

    async def run(
        self,
        node: str,
        site: str,
        address: NodeAddress | None,
        status_filter: str,
        change: Change,
    ) -> Outcome:
        if not await aiokit.wait_first(self._bus.connected, self._deadline - self._loop.time()):
            where = self._settings.where()
            msg = f"no answer from the MQTT broker {where} within {self._timeout_s:g} s"
            raise TransportError(msg)
        if address is None:
            address = await self._find(node, site, status_filter)
        assign_topic = self._topics.node(address, "assign")
        current = await self._read(assign_topic, self._topics.node(address, "status"))
        return await self._publish(node, assign_topic, current, change)

    async def _find(self, node: str, site: str, status_filter: str) -> NodeAddress:
        """The node's place, from its retained status (online first, then the newest)."""
        found: dict[NodeAddress, Status] = {}
        until = self._deadline
        while (message := await next_message(self._bus, until)) is not None:
            parsed = self._topics.parse_node(message.topic)
            if parsed is None or parsed[1] != "status" or parsed[0].node != node:
                continue
            try:
                status = decode(message.payload, Status)
            except SchemaError:
                continue  # a cleared or malformed status says nothing of where it is
            if status.node != node:
                continue
            found[parsed[0]] = status
            until = min(until, self._loop.time() + SETTLE_S)
        if not found:
            msg = (
                f"node {node} not found: no retained status on {status_filter} within "
                f"{self._timeout_s:g} s (is its agent running, and the site {site!r} right? "
                "or give --row and --rack)"
            )
            raise NodeNotFoundError(msg)
        address = max(found, key=lambda a: (found[a].state == "online", found[a].ts_ns))
        self._bus.resubscribe(
            [
                (self._topics.node(address, "assign"), 1),
                (self._topics.node(address, "status"), 1),
            ]
        )
        return address

    async def _read(self, assign_topic: str, status_topic: str) -> Assignment | None:
        """The retained assignment (None: none, cleared or unreadable).

        Both topics are subscribed in one request, the assignment first: the broker sends
        their retained messages in that order, so the status marks the end.
        """
        current: Assignment | None = None
        until = min(self._deadline, self._loop.time() + READ_WAIT_S)
        while (message := await next_message(self._bus, until)) is not None:
            if message.topic == status_topic:
                break
            if message.topic == assign_topic:
                current = _decoded(message.payload)
        return current

    async def _publish(
        self, node: str, topic: str, current: Assignment | None, change: Change
    ) -> Outcome:
        latest = current
        top_seq = current.seq if current is not None else 0
        for _ in range(ATTEMPTS):
            classes = change.apply(latest.classes if latest is not None else {})
            seq: int | None = None
            payload = b""
            if classes is not None:
                seq = top_seq + 1
                payload = self._payload(classes, seq)
            await self._send(topic, payload)
            lost = False
            until = max(self._deadline, self._loop.time() + ECHO_MIN_S)
            while True:
                message = await next_message(self._bus, until)
                if message is None:
                    user = self._settings.username or "anonymous"
                    msg = (
                        f"the broker did not take the assignment on {topic} (it never came "
                        f"back): the ACL must let {user} write and read it"
                    )
                    raise NotTakenError(msg)
                if message.topic != topic:
                    continue
                if message.payload == payload:
                    break
                lost = True  # another writer's map came between our read and our message
                latest = _decoded(message.payload)
                top_seq = max(top_seq, latest.seq if latest is not None else 0)
            if not lost:
                return Outcome(node, topic, classes or {}, seq)
            top_seq = max(top_seq, seq or 0)
            latest, top_seq = self._drain(topic, latest, top_seq)
        msg = (
            f"the assignment on {topic} changed under this command {ATTEMPTS} times in a "
            "row (other writers); run it again"
        )
        raise ConflictError(msg)

    def _drain(
        self, topic: str, latest: Assignment | None, top_seq: int
    ) -> tuple[Assignment | None, int]:
        """Take what already arrived after our echo: the newest map to build on."""
        inbox = self._bus.inbox
        while not inbox.empty():
            message = inbox.get_nowait()
            if message.topic == topic:
                latest = _decoded(message.payload)
                top_seq = max(top_seq, latest.seq if latest is not None else 0)
        return latest, top_seq

    def _payload(self, classes: Mapping[str, str], seq: int) -> bytes:
        try:
            message = Assignment(ts_ns=self._clock_ns(), seq=seq, classes=dict(classes))
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            msg = f"the assignment cannot be sent: {first['msg']}"
            raise ConfigError(msg) from None
        payload = encode(message)
        if len(payload) > MAX_PAYLOAD_BYTES:
            msg = f"the assignment ({len(payload)} bytes) exceeds {MAX_PAYLOAD_BYTES} bytes"
            raise ConfigError(msg)
        return payload

    async def _send(self, topic: str, payload: bytes) -> None:
        left = max(self._deadline - self._loop.time(), ECHO_MIN_S)
        try:
            async with asyncio.timeout(left):
                sent = await self._bus.publish(OutMessage(topic, payload, qos=1, retain=True))
        except TimeoutError:
            sent = False
        if not sent:
            where = self._settings.where()
            msg = f"the MQTT broker {where} did not acknowledge the assignment on {topic}"
            raise TransportError(msg)


def _decoded(payload: bytes) -> Assignment | None:
    """A retained assignment; None when cleared (empty) or unreadable (replaced whole)."""
    if not payload:
        return None
    try:
        return decode(payload, Assignment)
    except SchemaError:
        return None
