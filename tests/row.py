"""A whole row in one process: an aggregator, agents on simulated GPUs, CDUs, one clock.

Everything runs on a ``MemoryBroker`` and one ``FakeClock`` (wall and monotonic, which a
test can also skew per agent), and nothing runs by itself: ``Row.step`` advances the clock
and drives each daemon's loop bodies in order (sample, deliver, aggregator step, deliver,
decide and write), so a test is deterministic and takes milliseconds of wall time per
simulated second. The daemons are the production ``Agent`` and ``Aggregator`` (their
``start``, ``handle_message``, ``tick``, ``control_step``, ``publish_telemetry`` and
``stop``), the GPUs the production ``SimulatedBackend`` behind the real ``ThreadedGpu``.

This module is test tooling; the real-broker tests in ``tests/integration`` stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polca.agent.config import Settings
from polca.agent.runtime import Agent
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.runtime import Aggregator
from polca.cdu.publisher import publish_plant_once
from polca.export.sink import MemorySink
from polca.gpu.simulated import SimulatedBackend
from polca.plant.cdu import SimulatedCdu
from polca.plant.ratings import CduRatings
from polca.policy import PolicyStore
from polca.telemetry.memory import MemoryBroker, MemoryBus
from polca.telemetry.messages import InMessage, OutMessage
from polca.telemetry.schema import Control, Meter, encode

ROOT = Path(__file__).resolve().parents[1]
SITE, ROW = "dc1", "row1"
S = 1_000_000_000
HOUR_NS = 3600 * S


@dataclass
class FakeClock:
    """Wall and monotonic time that move only when told to."""

    wall_ns: int = 1_700_000_000 * S
    mono_ns: int = 1_000 * S

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on both clocks."""
        self.wall_ns += int(seconds * S)
        self.mono_ns += int(seconds * S)

    def wall(self) -> int:
        """Unix ns."""
        return self.wall_ns

    def mono(self) -> int:
        """Monotonic ns."""
        return self.mono_ns

    def seconds(self) -> float:
        """Monotonic seconds (the simulated GPUs' clock)."""
        return self.mono_ns / S


@dataclass
class SkewedWall:
    """One machine's wall clock: the row's, plus an offset a test can step."""

    clock: FakeClock
    offset_ns: int = 0

    def __call__(self) -> int:
        return self.clock.wall_ns + self.offset_ns


@dataclass
class Node:
    """One agent of the row with its simulated GPUs and its own wall clock."""

    agent: Agent
    backend: SimulatedBackend
    wall: SkewedWall

    @property
    def bus(self) -> MemoryBus:
        """Its bus."""
        bus = self.agent.bus
        assert isinstance(bus, MemoryBus)
        return bus

    def locks_mhz(self) -> list[int | None]:
        """Each GPU's locked SM clock ceiling (None: unlocked)."""
        held = [self.backend.held(i)[0] for i in sorted(self.agent.core.infos)]
        return [lock[1] if lock else None for lock in held]


def policy_file(tmp_path: Path, *, on_stop: str = "restore", dwell_s: int = 2) -> Path:
    """The shipped A100 policy, GPU 0 high priority, a short dwell, no trend brake."""
    text = (ROOT / "policies" / "polca-a100.yaml").read_text(encoding="utf-8")
    text = text.replace("by_index: {}", "by_index: {0: high}", 1)
    text = text.replace("on_stop: fail_safe", f"on_stop: {on_stop}", 1)
    text = text.replace("dwell_s: 40 ", f"dwell_s: {dwell_s:<3d}", 1)
    start = text.index("trend:")
    text = text[:start] + text[text.index("\n", text.index("reaction_s", start)) + 1 :]
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@dataclass
class Row:
    """The row: ``await start()``, ``await step()`` as often as needed, ``await stop()``."""

    tmp_path: Path
    racks: Mapping[str, list[str]]
    budget_w: float
    gpus: int = 4
    cdus: Mapping[str, str] = field(default_factory=dict)  # rack -> CDU id (one loop each)
    policy: Path | None = None
    agent_overrides: dict[str, Any] = field(default_factory=dict)
    control_overrides: dict[str, Any] = field(default_factory=dict)
    aggregator_overrides: dict[str, Any] = field(default_factory=dict)
    node_specs: dict[str, dict[str, Any]] = field(default_factory=dict)  # topology per node
    clock: FakeClock = field(default_factory=FakeClock)
    broker: MemoryBroker = field(default_factory=MemoryBroker)
    meter_pct: float | None = None  # the row meter, as % of the budget (None: no meter)

    def __post_init__(self) -> None:
        self.tmp_path.mkdir(parents=True, exist_ok=True)
        self.policy = self.policy or policy_file(self.tmp_path)
        self.sink = MemorySink()
        self.aggregator = self._new_aggregator()
        self.nodes: dict[str, Node] = {}
        for rack, names in self.racks.items():
            for name in names:
                self.nodes[name] = self.new_node(rack, name)
        self.plants = {
            rack: SimulatedCdu(
                cdu,
                loop=f"loop-{rack}",
                ratings=CduRatings(heat_capacity_kw=40, design_flow_lpm=100),
                seed=1,
                clock=self.clock.seconds,
                time_ns=self.clock.wall,
            )
            for rack, cdu in self.cdus.items()
        }
        self.probe = self.broker.bus(
            Settings().mqtt, client_id="probe", subscriptions=[("polca/v1/#", 1)]
        )
        self.probe.connect()
        self.seen: list[InMessage] = []  # everything the probe received, in order
        self.urgent_steps = 0  # control steps run at once on an urgent reading

    # -- building -------------------------------------------------------------------------

    def _new_aggregator(self) -> Aggregator:
        assert self.policy is not None
        loops = [
            {
                "name": f"loop-{rack}",
                "cdu": cdu,
                "racks": [rack],
                "heat_capacity_kw": 40,
                "design_flow_lpm": 100,
            }
            for rack, cdu in self.cdus.items()
        ]
        settings = AggregatorSettings(
            site=SITE,
            instance="agg",
            policy_file=self.policy,
            state_dir=self.tmp_path / "aggregator",
            rows=[
                {
                    "name": ROW,
                    "budget_w": self.budget_w,
                    # The row's meter is a figure of the test's (meter_pct of the budget),
                    # not a device: it may read up to twice the budget ...
                    "meter_max_w": 2 * self.budget_w,
                    "racks": [
                        {
                            "name": rack,
                            "nodes": [
                                {"name": n, "non_gpu_w": 0.0, **self.node_specs.get(n, {})}
                                for n in names
                            ],
                        }
                        for rack, names in self.racks.items()
                    ],
                }
            ],
            control={
                "interval_s": 0.5,
                "lease_s": 3.0,
                "stale_after_s": 2.0,
                "warmup_s": 1.0,
                # ... and it repeats one figure while the agents cap: not a hung PDU card.
                "meter_frozen_readings": 100_000,
                **self.control_overrides,
            },
            cooling={"loops": loops},
            **self.aggregator_overrides,
        )
        return Aggregator(
            settings,
            sinks=[self.sink],
            clock_ns=self.clock.wall,
            mono_ns=self.clock.mono,
            bus_factory=self.broker.bus,
        )

    def new_node(self, rack: str, name: str, *, backend: SimulatedBackend | None = None) -> Node:
        """A node (not started); ``backend``: its GPUs, kept across an agent restart."""
        assert self.policy is not None
        wall = SkewedWall(self.clock)
        backend = backend or SimulatedBackend(
            count=self.gpus,
            model="A100-SXM4",
            load="constant:0.3",
            seed=7,
            clock=self.clock.seconds,
        )
        settings = Settings(
            topics={"site": SITE, "row": ROW, "rack": rack, "node": name},
            gpu={"backend": "simulated"},
            agent={
                "policy_file": self.policy,
                "state_dir": self.tmp_path / name,
                "startup_grace_s": 10,
                "publish_interval_s": 0.5,
                "control_issuers": ["agg"],
                **self.agent_overrides,
            },
        )
        agent = Agent(
            settings,
            backend=backend,
            policy_store=PolicyStore(self.policy),
            clock_ns=wall,
            mono_ns=self.clock.mono,
            bus_factory=self.broker.bus,
        )
        return Node(agent, backend, wall)

    # -- running --------------------------------------------------------------------------

    async def start(self, *, aggregator: bool = True) -> None:
        """Start every agent (and the aggregator), connected to the broker."""
        for node in self.nodes.values():
            await self.start_agent(node)
        if aggregator:
            await self.start_aggregator()
        self.deliver()

    async def start_agent(self, node: Node) -> None:
        """Start one agent and connect it."""
        await node.agent.start()
        node.bus.connect()

    async def start_aggregator(self) -> None:
        """Start the aggregator and connect it (its warm-up counts from ``clock.mono``)."""
        await self.aggregator.start()
        for bus in (self.aggregator.bus, *self.aggregator.intake_buses.values()):
            assert isinstance(bus, MemoryBus)
            bus.connect()

    async def restart_aggregator(self) -> None:
        """A new aggregator process (same configuration) in place of the old one."""
        self.aggregator = self._new_aggregator()
        await self.start_aggregator()

    def aggregator_bus(self) -> MemoryBus | None:
        """The aggregator's control connection, when it is connected."""
        bus = self.aggregator.bus
        return bus if isinstance(bus, MemoryBus) and bus.connected.is_set() else None

    def aggregator_buses(self) -> list[MemoryBus]:
        """Every connection of the aggregator (control, then nodes) that is connected."""
        buses = (self.aggregator.bus, *self.aggregator.intake_buses.values())
        return [b for b in buses if isinstance(b, MemoryBus) and b.connected.is_set()]

    def kill_aggregator(self) -> None:
        """The aggregator's process dies: every connection drops (its Last Will goes out)."""
        for bus in self.aggregator_buses():
            bus.drop()

    def deliver(self) -> None:
        """Hand every received message to its daemon, until no one has any left."""
        while True:
            moved = False
            self.seen.extend(self.probe.drain())
            buses = self.aggregator_buses()
            for bus in buses:
                for message in bus.drain():
                    moved = True
                    self.aggregator.handle_message(message)
            if buses and self.aggregator.control_wake.is_set():  # as its control loop would
                self.aggregator.control_wake.clear()
                self.aggregator.control_step(self.clock.seconds())
                self.urgent_steps += 1
            for node in self.nodes.values():
                if node.agent.bus is not None and node.bus.connected.is_set():
                    for message in node.bus.drain():
                        moved = True
                        node.agent.handle_message(message)
            if not moved:
                return

    async def step(self, seconds: float = 0.5) -> None:
        """Let ``seconds`` pass, then one round of every loop body of every daemon."""
        self.clock.advance(seconds)
        live = [n for n in self.nodes.values() if n.agent.bus and n.bus.connected.is_set()]
        for node in live:
            await node.agent.tick()
            node.agent.telemetry.publish()
        if self.meter_pct is not None:
            meter = Meter(ts_ns=self.clock.wall(), power_w=self.budget_w * self.meter_pct / 100)
            self.probe.publish_nowait(OutMessage(f"polca/v1/{SITE}/{ROW}/meter", encode(meter)))
        for rack, plant in self.plants.items():
            plant.set_rack_power_w({rack: self.rack_power_w(rack)})
            publish_plant_once(self.probe, plant, site=SITE)
        self.deliver()
        if self.aggregator_bus() is not None:
            self.aggregator.control_step(self.clock.seconds())
        self.deliver()
        for node in live:
            await node.agent.control_step()
        self.deliver()

    async def run(self, seconds: float, step_s: float = 0.5) -> None:
        """Step for ``seconds`` of simulated time."""
        for _ in range(round(seconds / step_s)):
            await self.step(step_s)

    async def stop(self) -> None:
        """Stop every daemon cleanly."""
        for node in self.nodes.values():
            if node.agent.bus is not None:
                await node.agent.stop()
        if self.aggregator.bus is not None:
            await self.aggregator.stop()

    # -- reading ----------------------------------------------------------------------------

    def rack_power_w(self, rack: str) -> float:
        """The simulated GPUs' power of one rack, from their latest samples."""
        total = 0.0
        for name in self.racks[rack]:
            for sample in self.nodes[name].agent.core.latest.values():
                total += (sample.power_mw or 0) / 1000
        return total

    def controls(self, *, scope: str = "row") -> list[Control]:
        """Every control message the row's probe saw, of one scope, in order."""
        self.deliver()
        out = []
        for message in self.seen:
            if message.topic.endswith("/control") and message.payload:
                control = Control.model_validate_json(message.payload)
                if control.scope == scope:
                    out.append(control)
        return out

    def levels(self) -> dict[str, int | None]:
        """Each agent's level in force (None: fail-safe or no decision)."""
        out: dict[str, int | None] = {}
        for name, node in self.nodes.items():
            d = node.agent.core.decision
            out[name] = None if d is None or d.fail_safe else d.level
        return out
