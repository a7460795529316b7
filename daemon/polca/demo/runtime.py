"""``run_demo``: start the demo row, run it until the duration or a signal, stop it in order.

The shell of ``polca demo``. Every part it starts is the production code (``Agent``,
``Aggregator``, the CDU publisher ``run_plant``, ``MqttBus``), configured here for the row
of ``options.py``; what the view shows is ``view.py``'s, the load ``load.py``'s. One
supervisor: a ``TaskGroup`` owns every task of the run.

Order. Startup: signal handlers -> work directory -> broker (embedded, or ``--broker``)
-> the row built (agents, aggregator, CDU plants, view) -> tasks started (with the row's
two feeds' PDUs, ``feeds.py``) -> the duration's timer (``--duration`` is the row's run
time, however long its setup took). Shutdown, on the stop event: the aggregator first
(agents without a controller's lease would fall to their fail-safe caps while stopping),
then the agents, then the view, the plants and the feeds, then the buses; the view's last
frame, the summary and the record are written before the broker and the work directory
go.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

import structlog

from polca import aiokit
from polca.agent.config import AgentSettings, Settings, TopicSettings
from polca.agent.runtime import Agent
from polca.aggregator.config import (
    AggregatorSettings,
    ControlSettings,
    NodeSpec,
    RackSpec,
    RowFeedSpec,
    RowSpec,
)
from polca.aggregator.runtime import Aggregator
from polca.cdu.publisher import run_plant
from polca.cooling.loops import CoolingSettings, LoopSpec
from polca.demo.counterfactual import ClassClocks, Counterfactual
from polca.demo.feeds import FEED_SOURCES, run_feeds
from polca.demo.load import gpu_classes, node_gpus, tenant_replays
from polca.demo.options import (
    AGGREGATOR_INSTANCE,
    CDU_RATINGS,
    NON_GPU_W,
    ROW,
    SITE,
    DemoOptions,
)
from polca.demo.view import DemoView
from polca.export.influx import make_sink
from polca.gpu.config import GpuSettings
from polca.gpu.simulated import SimulatedBackend
from polca.plant.cdu import SimulatedCdu
from polca.policy import Policy, PolicyStore, load_policy
from polca.settings import InfluxSettings, LoggingSettings, MqttSettings
from polca.telemetry.bus import MqttBus
from polca.telemetry.topics import Topics
from polca.workload.trace import Trace

__all__ = ["run_demo"]

_ANY: Final = "+"
"""MQTT's one-segment wildcard, as a topic segment: the builders then make a filter."""


@dataclass(frozen=True, slots=True)
class _Row:
    """What one run starts: the agents, the aggregator, the CDU plants and the live view."""

    agents: list[Agent]
    aggregator: Aggregator
    plants: list[SimulatedCdu]
    view: DemoView
    policy: Policy


async def run_demo(options: DemoOptions, *, out: TextIO = sys.stdout) -> DemoView:
    """Run broker, aggregator, agents and the live view until the duration or a signal."""
    stop = asyncio.Event()
    reload = asyncio.Event()
    aiokit.install_signal_handlers(stop, reload)
    topics = Topics()  # the default root, as the daemons' settings default to it
    async with contextlib.AsyncExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polca-demo-")))
        host, port = await _broker(options, stack, out)
        mqtt = MqttSettings(host=host, port=port, reconnect_min_s=0.2)
        row = _build_row(options, mqtt=mqtt, topics=topics, work=work)
        structlog.get_logger().info(
            "demo_started",
            nodes=len(options.nodes),
            budget_w=round(row.view.budget_w),
            nameplate_w=round(options.nameplate_w()),
        )
        await _run_row(row, options, mqtt=mqtt, topics=topics, stop=stop, out=out)
        _report(row, options, out)
    return row.view


async def _broker(
    options: DemoOptions, stack: contextlib.AsyncExitStack, out: TextIO
) -> tuple[str, int]:
    """The broker's address: ``options.broker``, else an embedded broker on a free port,
    stopped when ``stack`` closes."""
    if options.broker is not None:
        return options.broker
    from polca.telemetry.broker import EmbeddedBroker  # noqa: PLC0415 - the embedded extra

    broker = await stack.enter_async_context(EmbeddedBroker(host="127.0.0.1", port=0))
    host, port = "127.0.0.1", broker.port
    out.write(f"embedded MQTT broker on {host}:{port}\n")
    return host, port


def _build_row(options: DemoOptions, *, mqtt: MqttSettings, topics: Topics, work: Path) -> _Row:
    """Every part of the row, built and not started (no I/O but reading the policy)."""
    quiet = LoggingSettings(level="warning")
    budget_w = options.row_budget_w()
    agents, shadows = _agents(options, mqtt=mqtt, quiet=quiet, topics=topics, work=work)
    aggregator_settings = _aggregator_settings(
        options, mqtt=mqtt, quiet=quiet, topics=topics, work=work, budget_w=budget_w
    )
    sink = make_sink(aggregator_settings.influx, state_dir=work / "aggregator")
    aggregator = Aggregator(aggregator_settings, sinks=[sink] if sink is not None else [])
    policy = load_policy(options.policy).policy
    view = DemoView(options, budget_w)
    view.clocks = ClassClocks(options.model)
    view.counterfactual = Counterfactual(
        shadows,
        gpu_classes(policy, options.gpus_per_node),
        ClassClocks(options.model),
    )
    return _Row(agents, aggregator, _plants(options), view, policy)


def _agents(
    options: DemoOptions,
    *,
    mqtt: MqttSettings,
    quiet: LoggingSettings,
    topics: Topics,
    work: Path,
) -> tuple[list[Agent], list[SimulatedBackend]]:
    """One agent per node on its simulated GPUs, and a twin of each node's GPUs, never
    capped, for the counterfactual (the same seed and replay: the same load)."""
    replays = tenant_replays(options, Trace.load())
    agents = []
    shadows = []
    for number, (rack, node) in enumerate(options.nodes):
        shadows.append(node_gpus(options, number, replays[number]))  # never capped
        backend = node_gpus(options, number, replays[number])
        settings = Settings(
            mqtt=mqtt,
            logging=quiet,
            topics=TopicSettings(root=topics.root, site=SITE, row=ROW, rack=rack, node=node),
            gpu=GpuSettings(
                backend="simulated",
                simulated_count=options.gpus_per_node,
                simulated_model=options.model,
            ),
            agent=AgentSettings(
                policy_file=options.policy,
                state_dir=work / node,
                sample_interval_s=options.sample_interval_s,
                startup_grace_s=30.0,
                control_issuers=(AGGREGATOR_INSTANCE,),
            ),
        )
        agents.append(Agent(settings, backend=backend, policy_store=PolicyStore(options.policy)))
    return agents, shadows


def _aggregator_settings(
    options: DemoOptions,
    *,
    mqtt: MqttSettings,
    quiet: LoggingSettings,
    topics: Topics,
    work: Path,
    budget_w: float,
) -> AggregatorSettings:
    """The aggregator of the row: one row of ``options.racks`` racks at ``budget_w``, one
    cooling loop (and CDU) per rack, a 1 s control step, InfluxDB when ``--influx``."""
    nodes = options.nodes
    return AggregatorSettings(
        mqtt=mqtt,
        logging=quiet,
        topic_root=topics.root,
        site=SITE,
        instance=AGGREGATOR_INSTANCE,
        policy_file=options.policy,
        state_dir=work / "aggregator",
        rows=(
            RowSpec(
                name=ROW,
                budget_w=budget_w,
                feeds=tuple(
                    RowFeedSpec(
                        name=feed, rating_w=options.feed_fraction * budget_w, sources=(source,)
                    )
                    for feed, source in FEED_SOURCES.items()
                ),
                racks=tuple(
                    RackSpec(
                        name=f"rack{r + 1}",
                        nodes=tuple(
                            NodeSpec(name=node, non_gpu_w=NON_GPU_W)
                            for rack, node in nodes
                            if rack == f"rack{r + 1}"
                        ),
                    )
                    for r in range(options.racks)
                ),
            ),
        ),
        control=ControlSettings(interval_s=1.0, lease_s=10.0, warmup_s=5.0),
        cooling=CoolingSettings(
            loops=tuple(
                LoopSpec(
                    name=f"loop{r + 1}",
                    cdu=f"cdu{r + 1}",
                    racks=(f"rack{r + 1}",),
                    heat_capacity_kw=CDU_RATINGS.heat_capacity_kw,
                    design_flow_lpm=CDU_RATINGS.design_flow_lpm,
                )
                for r in range(options.racks)
            )
        ),
        influx=InfluxSettings(
            url=options.influx_url,
            api="v1" if options.influx_api == "v1" else "v2",
            flush_interval_s=1.0,
            write_every_s={"gpu": 2.0},
        ),
    )


def _plants(options: DemoOptions) -> list[SimulatedCdu]:
    """One simulated CDU per rack (``cdu<r>`` serving ``loop<r>``), on the real clock."""
    return [
        SimulatedCdu(
            f"cdu{r + 1}",
            loop=f"loop{r + 1}",
            ratings=CDU_RATINGS,
            seed=options.seed + r,
            heat_kw=10.0,
        )
        for r in range(options.racks)
    ]


def _view_subscriptions(topics: Topics) -> list[tuple[str, int]]:
    """What the live view reads, as (filter, QoS): the row's summary, its nodes' telemetry
    and events, the aggregators' events, the cooling loops' states and alarms, and the
    rack-scope control."""
    return [
        (topics.row_summary(SITE, ROW), 0),
        (topics.all_nodes(SITE, ROW, "telemetry"), 0),
        (topics.all_nodes(SITE, ROW, "events"), 0),
        (topics.aggregator(SITE, _ANY, "events"), 0),
        (topics.loop_state(SITE, _ANY), 0),
        (topics.loop_alarms(SITE, _ANY), 1),
        (topics.rack_control(SITE, ROW, _ANY), 0),
    ]


def _rack_power_w(view: DemoView, rack: str) -> Callable[[], dict[str, float]]:
    """A CDU plant's heat source: ``rack``'s power in the view's latest row summary."""

    def power() -> dict[str, float]:
        summary = view.summary
        if summary is None:
            return {}
        return {r.rack: r.power_w for r in summary.racks if r.rack == rack}

    return power


def _schedule_incident(options: DemoOptions, plants: list[SimulatedCdu]) -> None:
    """The scripted incident: the second CDU's pump fails ``incident_at_s`` after the
    start and is repaired ``incident_s`` later (none with one rack or none asked)."""
    if options.incident_at_s is None or len(plants) <= 1:
        return
    loop = asyncio.get_running_loop()
    victim = plants[1]
    loop.call_later(options.incident_at_s, victim.fail_pump)
    loop.call_later(options.incident_at_s + options.incident_s, victim.restore_pump)


async def _run_row(
    row: _Row,
    options: DemoOptions,
    *,
    mqtt: MqttSettings,
    topics: Topics,
    stop: asyncio.Event,
    out: TextIO,
) -> None:
    """Start every task of the row, wait for ``stop``, then stop them in order."""
    cdu_bus = MqttBus(mqtt, client_id="polca-demo-cdus")
    view_bus = MqttBus(mqtt, client_id="polca-demo-view", subscriptions=_view_subscriptions(topics))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(view_bus.run())
        view_task = tg.create_task(_live_view(view_bus, row.view, out, tty=out.isatty()))
        agg_task = tg.create_task(row.aggregator.run())
        agent_tasks = [tg.create_task(a.run()) for a in row.agents]
        tg.create_task(cdu_bus.run())
        plant_tasks = [
            tg.create_task(
                run_plant(
                    cdu_bus,
                    plant,
                    site=SITE,
                    interval_s=1.0,
                    rack_power_w=_rack_power_w(row.view, f"rack{r + 1}"),
                    topics=topics,
                )
            )
            for r, plant in enumerate(row.plants)
        ]
        feeds_task = tg.create_task(run_feeds(cdu_bus, row.view, options, topics))
        _schedule_incident(options, row.plants)
        if options.duration_s is not None:  # the row's run time, not counting its setup
            asyncio.get_running_loop().call_later(options.duration_s, stop.set)
        await stop.wait()
        # Stop the controller first so agents don't fail-safe while stopping.
        row.aggregator.stop_requested.set()
        await agg_task
        for agent in row.agents:
            agent.stop_requested.set()
        await asyncio.gather(*agent_tasks)
        # The view and the plants run until cancelled; the buses then flush and close.
        view_task.cancel()
        feeds_task.cancel()
        for task in plant_tasks:
            task.cancel()
        await cdu_bus.close(timeout_s=1.0)
        await view_bus.close(timeout_s=1.0)


async def _live_view(bus: MqttBus, view: DemoView, out: TextIO, *, tty: bool) -> None:
    """Feed ``view`` the bus's messages, sample the counterfactual at the agents' interval,
    and redraw once a second (clearing the screen on a terminal); until cancelled."""

    async def consume() -> None:
        while True:
            view.handle(await bus.get())

    async def sample() -> None:
        while True:
            await asyncio.sleep(view.options.sample_interval_s)
            view.sample_counterfactual()

    async def draw() -> None:
        while True:
            await asyncio.sleep(1.0)
            view.tick()
            text = view.render()
            out.write(("\x1b[H\x1b[2J" + text) if tty else text)
            out.flush()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(consume())
        tg.create_task(sample())
        tg.create_task(draw())


def _report(row: _Row, options: DemoOptions, out: TextIO) -> None:
    """The view's last frame, the closing summary and, with ``--record``, the record."""
    out.write(row.view.render())
    out.write(row.view.closing_summary())
    if options.record_dir is not None:
        paths = row.view.write_record(options.record_dir, row.policy.classes)
        out.write(f"recorded           : {', '.join(str(p) for p in paths)}\n")
    out.flush()
