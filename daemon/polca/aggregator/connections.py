"""Which connection carries what: the aggregator's MQTT connections and its etcd elector.

Why a module: the broker queues messages per connection, so which topics share one is a
decision with consequences (a node flooding its topics delays only the nodes on its
connection), and it must be testable without a broker. The control connection carries
control, summaries, status and events out and the owned rows' control in
(``Intake.subscriptions``); ``intake_plan`` spreads the nodes' topics over
``intake.connections`` connections (``nodes-N``, by ``node_shard``), keeps a
``quarantine`` connection (empty until a node floods) and gives meters and CDUs one of
their own (``sources``). ``quarantine`` says which connections change when the intake
moves a node off its shared connection.

Nothing here connects: ``make_buses`` and ``elector`` build the buses and the etcd
campaign from these plans (no I/O until their ``run``), which the shell (``runtime.py``)
runs and closes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polca import service
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.intake import Intake, NodeMoveKind, node_shard
from polca.coord.etcd import Elector, elector_for
from polca.coord.leadership import Leadership
from polca.telemetry.messages import Bus, BusFactory, BusStats, InMessage, OutMessage

Subscriptions = list[tuple[str, int]]
"""Topic filters with their QoS, as a bus subscribes them."""

__all__ = [
    "NodeMove",
    "Subscriptions",
    "client_id",
    "close",
    "elector",
    "intake_cut",
    "intake_plan",
    "make_buses",
    "move_node",
    "resign",
    "resubscribe",
    "stats",
    "tasks",
]


SOURCES = "sources"
"""The intake connection of the meters and CDUs."""


def client_id(settings: AggregatorSettings) -> str:
    """The control connection's MQTT client id; an intake connection's adds ``-<name>``."""
    return settings.mqtt.client_id or f"polca-aggregator-{settings.instance}"


def intake_plan(intake: Intake, connections: int) -> dict[str, Subscriptions]:
    """The connections that only take messages in, by name, with their subscriptions.

    ``nodes-N`` for each of ``connections`` that carries a node, ``sources`` when there
    are meters or CDUs, and ``quarantine`` always (a node moved there later needs it).
    """
    shards = intake.node_subscriptions(connections)
    shards[SOURCES] = intake.source_subscriptions()
    return {name: subs for name, subs in shards.items() if subs or name == "quarantine"}


def make_buses(
    factory: BusFactory,
    settings: AggregatorSettings,
    intake: Intake,
    *,
    will: OutMessage,
    birth: Callable[[], Sequence[OutMessage]],
    clock_ns: Callable[[], int],
    mono_ns: Callable[[], int],
) -> tuple[Bus, dict[str, Bus]]:
    """The control connection (its Last Will ``will``, ``birth`` on every connect) and the
    intake connections by name (``intake_plan``), made but not connected."""
    control_id = client_id(settings)
    control = factory(
        settings.mqtt,
        client_id=control_id,
        will=will,
        subscriptions=intake.subscriptions(),
        birth=birth,
        clock_ns=clock_ns,
        mono_ns=mono_ns,
    )
    plan = intake_plan(intake, settings.intake.connections)
    buses = {
        name: factory(
            settings.mqtt,
            client_id=f"{control_id}-{name}",
            subscriptions=subscriptions,
            clock_ns=clock_ns,
            mono_ns=mono_ns,
            # Meters and CDUs publish readings only, never retained: under MQTT 5 a
            # reading sent retained shows as one live too, and is refused as one.
            retain_as_published=name == SOURCES,
        )
        for name, subscriptions in plan.items()
    }
    return control, buses


@dataclass(frozen=True, slots=True)
class NodeMove:
    """A node moved between its shared connection and the ``quarantine`` one."""

    row: str
    node: str
    kind: NodeMoveKind
    """``quarantined`` (a flooding node moved off its shared connection) or ``released``
    (moved back, its flood over); the event published is ``node_<kind>``."""
    shared: str
    """The connection it shares with other nodes (for the event)."""
    resubscribe: dict[str, Subscriptions]
    """The connections whose subscriptions change, with their new ones."""


def move_node(
    intake: Intake, row: str, node: str, kind: NodeMoveKind, connections: int
) -> NodeMove:
    """Move ``node`` of ``row`` (already marked by the intake) between its connections.

    Quarantined, its shared connection drops its topics, so that connection's broker queue
    drains and the other nodes' readings get through again; the quarantine connection takes
    them, so the node's own readings still count. Released, the reverse.
    """
    shared = node_shard(node, connections)
    shards = intake.node_subscriptions(connections)
    moved = {name: shards[name] for name in (shared, "quarantine")}
    return NodeMove(row, node, kind, shared, moved)


def elector(
    settings: AggregatorSettings,
    *,
    leadership: Leadership,
    on_change: Callable[[], object],
    mono_ns: Callable[[], int],
) -> Elector | None:
    """The shard's campaign on etcd when ``ha`` is enabled (built, not connected)."""
    ha = settings.ha
    return elector_for(
        ha,
        key=f"{ha.key_prefix}/{settings.site}/{settings.shard}",
        instance=settings.instance,
        leadership=leadership,
        on_change=on_change,
        mono_ns=mono_ns,
    )


def intake_cut(control: Bus | None, intake: Mapping[str, Bus]) -> bool:
    """Whether any connection is without its subscriptions now: after a failover the
    broker may take seconds (a cluster electing) to grant them, and nothing flows in on
    that connection till then, so the rows' inputs are cut (``RowSet.intake_cut``)."""
    buses = (control, *intake.values())
    return any(bus is not None and not bus.subscribed.is_set() for bus in buses)


def tasks(
    control: Bus,
    intake: Mapping[str, Bus],
    elector: Elector | None,
    *,
    handler: Callable[[InMessage], None],
) -> dict[str, Coroutine[Any, Any, object]]:
    """The connections the shell supervises, by task name: ``mqtt`` (the control
    connection), ``mqtt-<name>`` for each intake one, ``etcd`` with an elector. Every bus
    hands each received message to ``handler`` on arrival."""
    runs: dict[str, Coroutine[Any, Any, object]] = {"mqtt": control.run()}
    control.set_handler(handler)
    for name, bus in intake.items():
        bus.set_handler(handler)
        runs[f"mqtt-{name}"] = bus.run()
    if elector is not None:
        runs["etcd"] = elector.run()
    return runs


def stats(control: Bus | None, intake: Mapping[str, Bus]) -> dict[str, BusStats]:
    """Each MQTT connection's counters, by name (``control`` and the intake ones)."""
    buses = {"control": control, **intake}
    return {name: bus.stats for name, bus in buses.items() if bus is not None}


async def resign(elector: Elector | None, log: Any) -> None:
    """Give up the lead at a stop (a standby leads at its next campaign), bounded."""
    if elector is not None:
        bound_s = service.STOP_BOUNDS.session_s
        await service.bounded(elector.resign(), bound_s, "leadership_not_resigned", log)
        await elector.client.close()


async def close(
    control: Bus | None, intake: Mapping[str, Bus], *, final: OutMessage, log: Any
) -> None:
    """Close the intake connections, then the control one with ``final`` (the ``offline``
    status) sent first, each bounded (``service.STOP_BOUNDS``)."""
    bounds = service.STOP_BOUNDS
    for bus in intake.values():
        await service.bounded(bus.close(), bounds.intake_s, "intake_connection_not_closed", log)
    if control is not None:
        done = control.close(final=[final])
        await service.bounded(done, bounds.final_messages_s, "final_status_not_sent", log)


def resubscribe(intake: Mapping[str, Bus], moved: NodeMove) -> None:
    """Carry out a node's move: each changed connection subscribes its new topics (none
    exist before the aggregator started)."""
    for name, subscriptions in moved.resubscribe.items():
        bus = intake.get(name)
        if bus is not None:
            bus.resubscribe(subscriptions)
