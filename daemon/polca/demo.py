"""``polca demo``: a whole oversubscribed row on one machine, with nothing to install.

One process runs an embedded MQTT broker (or uses ``--broker``), the aggregator, and a row
of simulated nodes (racks of 8-GPU nodes) serving LLM-inference load replayed from the
bundled Azure request trace by several services (``tenants``) at their own phases. The
row's budget is the smallest the planner signs for this load and policy (``polca plan
--history`` on ``uncapped_load``, ``bench/demo_plan.py``): below what the load can draw at
its bursts, so the controller really caps, within POLCA's SLOs. A live view shows row
power against the budget and thresholds, the level, per-rack power and the hottest GPUs;
``--influx URL`` also writes everything to InfluxDB; ``--duration`` bounds the run, which
ends with a summary: time at each level, brake events, capping events and peak row power
as % of budget. Beside the row,
``Counterfactual`` runs the same GPUs under the same load uncapped (the replay's load does
not depend on the caps), so the view and the summary show what polca buys: the uncapped
peak, the servers the budget would hold at it, and the clock each class gave up.

Everything here is the production code: agents, aggregator, policy engine, MQTT; only the
GPUs are simulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, TextIO

import structlog

from polca import aiokit
from polca.agent.runtime import Agent
from polca.aggregator.config import (
    AggregatorSettings,
    ControlSettings,
    NodeSpec,
    RackSpec,
    RowSpec,
)
from polca.aggregator.runtime import Aggregator
from polca.cooling.loops import CoolingSettings, LoopSpec
from polca.cooling.plant import CduRatings, SimulatedCdu
from polca.cooling.publisher import run_plant
from polca.export.influx import make_sink
from polca.gpu.simulated import SimulatedBackend
from polca.physics import power
from polca.physics.presets import get_model
from polca.policy import Policy, PolicyStore, load_policy
from polca.settings import (
    AgentSettings,
    GpuSettings,
    InfluxSettings,
    LoggingSettings,
    MqttSettings,
    Settings,
    TopicSettings,
)
from polca.telemetry.bus import InMessage, MqttBus
from polca.telemetry.schema import (
    Control,
    CoolingAlarm,
    CoolingLoopState,
    Event,
    RowSummary,
    SchemaError,
    Telemetry,
    decode,
)
from polca.workload.replay import TraceReplay, trace_loads
from polca.workload.trace import Trace

if TYPE_CHECKING:
    from polca.sim.agreement import DemoRow

DEMO_POLICY = Path(__file__).resolve().parents[2] / "policies" / "simulated-demo.yaml"
SITE = "demo"
AGGREGATOR_INSTANCE = "demo-aggregator"
ROW = "row1"
NON_GPU_W = 1500.0  # CPUs, memory, NICs and fans of an 8-GPU server
RECORD_MAX: Final = 86_400
"""Seconds of row and uncapped power a run keeps for ``--record`` (the last day at 1 Hz)."""
# One in-row CDU per rack, sized for a rack of four 8-GPU nodes (~35 kW at full load).
CDU_RATINGS = CduRatings(heat_capacity_kw=40.0, design_flow_lpm=60.0)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """The shape of the demo row and its load."""

    racks: int = 3
    nodes_per_rack: int = 4
    gpus_per_node: int = 8
    model: str = "H100-SXM"
    budget_w: float | None = None  # default: budget_fraction of the row's nameplate
    budget_fraction: float = 0.775  # the smallest the planner signs for this load (§6)
    speedup: float = 2.0
    scale: float = 16.0
    tenants: int = 4  # services at independent phases of the trace, nodes dealt in turn
    offset_s: float = 756.0  # trace seconds skipped: the largest burst of a lap comes ~1 min in
    seed: int = 0
    policy: Path = DEMO_POLICY
    duration_s: float | None = None
    influx_url: str | None = None
    influx_api: str = "v2"  # v1 for InfluxDB 1.x (database "polca")
    broker: tuple[str, int] | None = None
    sample_interval_s: float = 0.25
    incident_at_s: float | None = 45.0  # a CDU pump fails this long after the start
    incident_s: float = 30.0  # ... and is repaired after this long
    record_dir: Path | None = None  # write the run's row and uncapped power here (CSV)

    @property
    def nodes(self) -> list[tuple[str, str]]:
        """(rack, node) for every node of the row."""
        return [
            (f"rack{r + 1}", f"node{r + 1}{n + 1:02d}")
            for r in range(self.racks)
            for n in range(self.nodes_per_rack)
        ]

    def row_budget_w(self) -> float:
        """The row's budget: ``budget_w``, else ``budget_fraction`` of the nameplate."""
        return self.budget_w or self.budget_fraction * self.nameplate_w()

    def planner_row(self) -> DemoRow:
        """The row as the simulator sees it (``polca.sim.agreement``: the agreement check
        and ``plan_demo_row``)."""
        from polca.sim.agreement import DemoRow  # noqa: PLC0415 - numpy: the sim extra

        return DemoRow(
            budget_w=self.row_budget_w(),
            servers=len(self.nodes),
            gpus_per_server=self.gpus_per_node,
            model=self.model,
            non_gpu_w=NON_GPU_W,
        )

    def nameplate_w(self) -> float:
        """The row's nameplate: every GPU at its default limit plus non-GPU power."""
        gpu_w = get_model(self.model).tdp_mw / 1000.0
        return len(self.nodes) * (self.gpus_per_node * gpu_w + NON_GPU_W)


DECODE_SHARE: Final = 0.5
"""Share of a busy GPU's time spent decoding, as the planner's ``--decode-share`` default."""


class ClassClocks:
    """Per priority class, over GPU samples: the mean SM clock, and the mean work slowdown
    of the busy GPUs at the clocks they ran, by the planner's clock -> latency relation
    (``physics.power.work_slowdown``, with the profile's exponents for the demo's GPU
    model), so that the demo's latency cost per class is the planner's model of it."""

    def __init__(self, model: str) -> None:
        from polca.sim.profile import shipped_profile  # noqa: PLC0415 - no numpy needed

        gpu, _ = shipped_profile(model.lower()).values()
        self.prefill_exponent = float(gpu["prefill_clock_exponent"])
        self.decode_exponent = float(gpu["decode_clock_exponent"])
        self.max_clock_mhz = get_model(model).sm_clock_max_mhz
        self._clock: dict[str, list[float]] = {}  # class -> [MHz sum, samples]
        self._slowdown: dict[str, list[float]] = {}  # class -> [slowdown sum, busy samples]

    def add(self, cls: str, sm_clock_mhz: int | None, util_pct: float | None) -> None:
        """One GPU sample; idle GPUs (no utilization) carry no work, so no slowdown."""
        if sm_clock_mhz is None:
            return
        _accumulate(self._clock, cls, sm_clock_mhz)
        if not sm_clock_mhz > 0 or not (util_pct or 0.0) > 0.0:
            return
        slow = power.work_slowdown(
            min(1.0, sm_clock_mhz / self.max_clock_mhz),
            decode_share=DECODE_SHARE,
            prefill_clock_exponent=self.prefill_exponent,
            decode_clock_exponent=self.decode_exponent,
        )
        _accumulate(self._slowdown, cls, slow)

    def classes(self) -> list[str]:
        """The classes seen so far, sorted."""
        return sorted(self._clock)

    def mean_clock_mhz(self, cls: str) -> float | None:
        """The class's time-averaged SM clock so far."""
        return _mean(self._clock, cls)

    def mean_slowdown(self, cls: str) -> float | None:
        """The class's mean slowdown so far (1.0: as fast as at the maximum clock)."""
        return _mean(self._slowdown, cls)


def _accumulate(sums: dict[str, list[float]], cls: str, value: float) -> None:
    acc = sums.setdefault(cls, [0.0, 0.0])
    acc[0] += value
    acc[1] += 1


def _mean(sums: dict[str, list[float]], cls: str) -> float | None:
    total, count = sums.get(cls, (0.0, 0.0))
    return total / count if count else None


@dataclass(slots=True)
class DemoView:
    """Consumes the row's messages; renders the live view and the closing summary."""

    options: DemoOptions
    budget_w: float
    summary: RowSummary | None = None
    level_s: Counter[str] = field(default_factory=Counter)
    peak_pct: float = 0.0
    brake_events: int = 0
    cap_changes: int = 0
    level_changes: deque[str] = field(default_factory=lambda: deque(maxlen=6))
    hottest: dict[str, tuple[float, int, int | None, str | None]] = field(default_factory=dict)
    started_s: float = field(default_factory=time.monotonic)
    clock: Callable[[], float] = time.monotonic  # what started_s and the record's times read
    last_level: int = 0
    loops: dict[str, CoolingLoopState] = field(default_factory=dict)
    cooling_events: deque[str] = field(default_factory=lambda: deque(maxlen=8))
    cooling_alarms_raised: int = 0
    rack_levels: dict[str, int] = field(default_factory=dict)
    counterfactual: Counterfactual | None = None
    uncapped_w: float | None = None
    uncapped_peak_w: float = 0.0
    clocks: ClassClocks | None = None  # the row's GPUs, by class
    started_wall_s: float = field(default_factory=time.time)
    # (s since start, row power W, level, level name), one per row summary
    row_record: deque[tuple[float, float, int, str]] = field(
        default_factory=lambda: deque(maxlen=RECORD_MAX)
    )
    # (s since start, uncapped row power W, uncapped GPU power W per class), once a second
    uncapped_record: deque[tuple[float, float, dict[str, float]]] = field(
        default_factory=lambda: deque(maxlen=RECORD_MAX)
    )
    _uncapped_sum: list[float] = field(default_factory=lambda: [0.0, 0])  # [W sum, count]
    _uncapped_class_sum: dict[str, float] = field(default_factory=dict)

    def handle(self, message: InMessage) -> None:
        """Take one message of the demo site."""
        try:
            payload = decode(message.payload)
        except SchemaError:
            return
        if isinstance(payload, RowSummary):
            self._on_summary(payload)
        elif isinstance(payload, Telemetry):
            hot = max(
                (g for g in payload.gpus if g.gpu_temp_c is not None),
                key=lambda g: g.gpu_temp_c or 0.0,
                default=None,
            )
            for g in payload.gpus:
                if self.clocks is not None and g.priority_class is not None:
                    self.clocks.add(g.priority_class, g.sm_clock_mhz, g.gpu_util_pct)
            if hot is not None and hot.gpu_temp_c is not None:
                self.hottest[payload.node] = (
                    hot.gpu_temp_c,
                    hot.index,
                    hot.sm_clock_mhz,
                    hot.priority_class,
                )
        elif isinstance(payload, Event):
            if payload.event in ("cap_changed", "cap_reasserted"):
                gpus = payload.detail.get("gpus")
                self.cap_changes += len(gpus) if isinstance(gpus, list) else 0
            elif payload.event == "level_changed":
                stamp = time.monotonic() - self.started_s
                self.level_changes.append(
                    f"{stamp:6.0f} s  {payload.detail.get('level_name', '?'):<8} "
                    f"{payload.detail.get('reason', '')}"
                )
        elif isinstance(payload, CoolingLoopState):
            self.loops[payload.loop] = payload
        elif isinstance(payload, CoolingAlarm):
            stamp = time.monotonic() - self.started_s
            if payload.action == "raised":
                self.cooling_alarms_raised += 1
            self.cooling_events.append(
                f"{stamp:6.0f} s  {payload.loop} {payload.alarm} {payload.action} "
                f"({payload.severity})"
            )
        elif isinstance(payload, Control) and payload.scope == "rack" and payload.rack:
            self.rack_levels[payload.rack] = payload.level

    def sample_counterfactual(self) -> None:
        """At the agents' sample interval: read the uncapped counterfactual of the same load."""
        if self.counterfactual is not None:
            total_w, by_class = self.counterfactual.sample()
            self._uncapped_sum[0] += total_w
            self._uncapped_sum[1] += 1
            for cls, power_w in by_class.items():
                self._uncapped_class_sum[cls] = self._uncapped_class_sum.get(cls, 0.0) + power_w

    def tick(self) -> None:
        """Once a second: the counterfactual's mean over the second, as agents report theirs
        (a peak of instantaneous readings would sit above the row's 1 s means)."""
        if self.counterfactual is not None and not self._uncapped_sum[1]:
            self.sample_counterfactual()
        total, count = self._uncapped_sum
        if count:
            self.uncapped_w = total / count
            by_class = {cls: w / count for cls, w in self._uncapped_class_sum.items()}
            self.uncapped_peak_w = max(self.uncapped_peak_w, self.uncapped_w)
            self.uncapped_record.append((self._since_start_s(), self.uncapped_w, by_class))
        self._uncapped_sum = [0.0, 0]
        self._uncapped_class_sum = {}

    def _since_start_s(self) -> float:
        return self.clock() - self.started_s

    def _on_summary(self, summary: RowSummary) -> None:
        self.summary = summary
        pct = 100.0 * summary.power_w / summary.effective_budget_w
        self.peak_pct = max(self.peak_pct, pct)
        self.level_s[summary.level_name or str(summary.level)] += 1
        self.row_record.append(
            (
                self._since_start_s(),
                summary.power_w,
                summary.level,
                summary.level_name or str(summary.level),
            )
        )
        top = len(summary.thresholds_w)
        if summary.level == top and self.last_level != top:
            self.brake_events += 1
        self.last_level = summary.level

    def write_record(self, directory: Path, classes: tuple[str, ...]) -> list[Path]:
        """The run as two CSV files in ``directory``: ``row.csv`` (timestamp, the row's
        power and level, per row summary) and ``uncapped.csv`` (timestamp, the uncapped
        counterfactual's row power and its GPU power of the first class, ``hp_power_w``,
        and of the others, ``lp_power_w``): a power history ``polca plan --history``
        reads. Timestamps are Unix seconds (the run's monotonic offsets from its start).
        """
        directory.mkdir(parents=True, exist_ok=True)
        row_path, uncapped_path = directory / "row.csv", directory / "uncapped.csv"
        t0 = self.started_wall_s
        with row_path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["timestamp", "power_w", "level", "level_name"])
            for t_s, power_w, level, name in self.row_record:
                writer.writerow([f"{t0 + t_s:.3f}", f"{power_w:.1f}", level, name])
        self.write_uncapped(uncapped_path, classes)
        return [row_path, uncapped_path]

    def write_uncapped(self, path: Path, classes: tuple[str, ...]) -> None:
        """``uncapped.csv`` alone (``write_record``): timestamp, the counterfactual's row
        power, its GPU power of the first class and of the others."""
        t0 = self.started_wall_s
        first = classes[0] if classes else None
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["timestamp", "power_w", "hp_power_w", "lp_power_w"])
            for t_s, total_w, by_class in self.uncapped_record:
                hp_w = by_class.get(first, 0.0) if first is not None else 0.0
                lp_w = sum(w for c, w in by_class.items() if c != first)
                writer.writerow([f"{t0 + t_s:.3f}", f"{total_w:.1f}", f"{hp_w:.1f}", f"{lp_w:.1f}"])

    def render(self) -> str:
        """The live view as text."""
        o = self.options
        head = (
            f"polca demo  row {ROW}: {o.racks} racks x {o.nodes_per_rack} nodes x "
            f"{o.gpus_per_node} {o.model}, budget {self.budget_w / 1000:.1f} kW, "
            f"trace x{o.speedup:g} speed x{o.scale:g} load, "
            f"{time.monotonic() - self.started_s:.0f} s"
        )
        s = self.summary
        if s is None:
            return head + "\n  waiting for the aggregator's first row summary...\n"
        pct = 100.0 * s.power_w / s.effective_budget_w
        width = 50
        bar = ["#" if i < min(width, int(pct / 110 * width)) else "." for i in range(width)]
        for threshold in s.thresholds_w:
            pos = int(100 * threshold / s.effective_budget_w / 110 * width)
            if 0 <= pos < width:
                bar[pos] = "|"
        trend = f"{s.trend_w_per_s:+.0f} W/s" if s.trend_w_per_s is not None else "-"
        uncapped = ""
        if self.uncapped_w is not None:
            uncapped = (
                f"  uncapped {self.uncapped_w / 1000:.1f} kW "
                f"({100.0 * self.uncapped_w / s.effective_budget_w:.0f}%)"
            )
        lines = [
            head,
            f"  row   {s.power_w / 1000:6.1f} kW  {pct:5.1f}% [{''.join(bar)}]  "
            f"level {s.level_name:<8} trend {trend}{uncapped}",
            "        thresholds: "
            + ", ".join(
                f"{100 * t / s.effective_budget_w:.0f}% = {t / 1000:.1f} kW" for t in s.thresholds_w
            ),
        ]
        for rack in s.racks:
            share = rack.power_w / max(s.power_w, 1.0)
            forced = f"  rack level {rack.level}" if rack.level else ""
            lines.append(
                f"  {rack.rack:<6}{rack.power_w / 1000:6.1f} kW  {'=' * int(share * 40):<40}"
                f"  {rack.nodes_online} up, {rack.nodes_stale} stale, {rack.nodes_offline} off"
                f"{forced}"
            )
        for name, loop in sorted(self.loops.items()):
            alarms = ", ".join(f"{a.alarm} {a.severity}" for a in loop.alarms) or "ok"
            lines.append(
                f"  {name:<6}{loop.cdu}: supply {loop.supply_temp_c or 0:4.1f} C, flow "
                f"{100 * (loop.flow_fraction or 0):3.0f}%, heat {loop.heat_load_kw or 0:4.1f}"
                f"/{loop.capacity_kw or 0:4.1f} kW  {alarms}"
            )
        hot = sorted(self.hottest.items(), key=lambda kv: -kv[1][0])[:3]
        if hot:
            lines.append(
                "  hottest: "
                + "; ".join(
                    f"{node}/gpu{index} {temp:.0f} C {clock or 0} MHz ({cls})"
                    for node, (temp, index, clock, cls) in hot
                )
            )
        if self.level_changes:
            lines.append("  level changes:")
            lines.extend(f"   {entry}" for entry in self.level_changes)
        if self.cooling_events:
            lines.append("  cooling alarms:")
            lines.extend(f"   {entry}" for entry in self.cooling_events)
        return "\n".join(lines) + "\n"

    def closing_summary(self) -> str:
        """Time at each level, brake and capping events, peak power."""
        total = sum(self.level_s.values()) or 1
        lines = ["", "== polca demo summary =="]
        for name, count in sorted(self.level_s.items(), key=lambda kv: -kv[1]):
            lines.append(f"time at {name:<8}: {count:5d} s ({100.0 * count / total:5.1f}%)")
        lines.append(f"brake events       : {self.brake_events}")
        lines.append(f"cooling alarms     : {self.cooling_alarms_raised} raised")
        lines.extend(f"   {entry}" for entry in self.cooling_events)
        lines.append(f"GPU cap changes    : {self.cap_changes}")
        lines.append(
            f"peak row power     : {self.peak_pct:.1f}% of the {self.budget_w / 1000:.1f} kW budget"
            + (
                f" with polca; {100.0 * self.uncapped_peak_w / self.budget_w:.1f}% without "
                "(the same load, uncapped)"
                if self.uncapped_peak_w
                else ""
            )
        )
        lines.extend(self._what_polca_buys())
        return "\n".join(lines) + "\n"

    def _what_polca_buys(self) -> list[str]:
        """Extra servers and the clock given up for them, from the counterfactual."""
        cf = self.counterfactual
        if cf is None or not self.uncapped_peak_w or self.clocks is None:
            return []
        nodes = len(self.options.nodes)
        fits = int(self.budget_w // (self.uncapped_peak_w / nodes))
        lines = [
            f"servers            : {nodes} nodes on a budget that holds {fits} at this load's "
            f"uncapped peak: {100.0 * (nodes / max(fits, 1) - 1.0):+.0f}% with "
            f"{self.brake_events} brake events"
        ]
        given, cost = [], []
        for cls in self.clocks.classes():
            clock, base = self.clocks.mean_clock_mhz(cls), cf.clocks.mean_clock_mhz(cls)
            if clock and base:
                given.append(f"{cls} {100.0 * (clock / base - 1.0):+.1f}%")
            capped, uncapped = self.clocks.mean_slowdown(cls), cf.clocks.mean_slowdown(cls)
            if capped and uncapped:
                cost.append(f"{cls} {100.0 * (capped / uncapped - 1.0):+.1f}%")
        if given:
            lines.append(
                f"clock given up     : {', '.join(given)} (time-averaged SM clock against "
                "the same GPUs uncapped)"
            )
        if cost:
            lines.append(
                f"latency cost       : {', '.join(cost)} (the planner's model: the same work "
                f"at each busy GPU's clock, prefill time ~ f^-{self.clocks.prefill_exponent:g}, "
                f"decode ~ f^-{self.clocks.decode_exponent:g}, half of it decoding)"
            )
        return lines


def tenant_replays(options: DemoOptions, trace: Trace) -> list[tuple[TraceReplay, int]]:
    """Per node of the row: the replay of its tenant and its place among the tenant's nodes.

    The row serves ``tenants`` services, each the bundled trace started at its own phase
    (spread evenly over one lap of the trace) with its own seed, its share of ``scale`` and
    its nodes dealt in turn (node ``n`` serves tenant ``n % tenants``), so that every rack
    carries every tenant. One tenant makes the row follow the trace's minute-scale bursts;
    several at independent phases smooth the row as services sharing a real row do
    (docs/evaluation.md §6). More tenants than nodes make one per node.
    """
    nodes = len(options.nodes)
    if options.tenants < 1:
        msg = f"tenants must be at least 1, got {options.tenants}"
        raise ValueError(msg)
    tenants = min(options.tenants, nodes)  # more tenants than nodes: one per node
    replays = []
    for k in range(tenants):
        share = len(range(k, nodes, tenants))  # nodes of tenant k
        replays.append(
            TraceReplay(
                trace,
                gpus=share * options.gpus_per_node,
                speedup=options.speedup,
                scale=options.scale * share / nodes,
                offset_s=options.offset_s + k * trace.duration_s / tenants,
                seed=options.seed * 100 + k,
                serving=options.model,
            )
        )
    return [(replays[n % tenants], n // tenants) for n in range(nodes)]


def _node_gpus(
    options: DemoOptions,
    number: int,
    replay: tuple[TraceReplay, int],
    clock: Callable[[], float] | None = None,
) -> SimulatedBackend:
    """Node ``number``'s simulated GPUs, each serving its share of its tenant's replay."""
    backend = SimulatedBackend(
        count=options.gpus_per_node,
        model=options.model,
        load="idle",
        seed=options.seed * 1000 + number,
        clock=clock,
    )
    tenant, local = replay
    for index, profile in enumerate(
        trace_loads(options.gpus_per_node, node_offset=local, replay=tenant)
    ):
        backend.set_load(index, profile)
    return backend


def _gpu_classes(policy: Policy, gpus_per_node: int) -> dict[int, str]:
    """GPU index -> priority class, as the policy assigns a node's GPUs statically."""
    return {i: policy.static_class(index=i, uuid="") for i in range(gpus_per_node)}


def uncapped_load(options: DemoOptions, duration_s: float) -> DemoView:
    """The demo row's uncapped load over ``duration_s`` without the daemons: the run's
    counterfactual (the same GPUs and replays) on a simulated clock, sampled at the agents'
    interval and recorded as 1 s means in a ``DemoView`` (``uncapped_record``,
    ``write_uncapped``). What ``polca plan --history`` takes to sign the demo's budget and
    policy (``bench/demo_plan.py``, ``tests/test_demo.py``)."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    replays = tenant_replays(options, Trace.load())
    backends = [_node_gpus(options, n, replays[n], clock) for n in range(len(options.nodes))]
    policy = load_policy(options.policy).policy
    view = DemoView(options, options.row_budget_w(), clock=clock, started_s=0.0)
    view.counterfactual = Counterfactual(
        backends, _gpu_classes(policy, options.gpus_per_node), ClassClocks(options.model)
    )
    per_s = max(1, round(1.0 / options.sample_interval_s))
    for second in range(int(duration_s)):
        for k in range(per_s):
            now[0] = second + k / per_s
            view.sample_counterfactual()
        now[0] = second + 1.0
        view.tick()
    return view


class Counterfactual:
    """The same row's GPUs under the same load, never capped: what polca's caps save.

    One ``SimulatedBackend`` per node with the node's seed and trace loads (the replay's
    utilization does not depend on the caps), read once a second on the event loop.
    """

    def __init__(
        self,
        backends: list[SimulatedBackend],
        classes: dict[int, str],
        clocks: ClassClocks,
    ) -> None:
        """``classes``: GPU index -> priority class (as the policy assigns them)."""
        self.backends = backends
        self.classes = classes
        self.clocks = clocks
        self._gpus = [(b, [info.index for info in b.discover()]) for b in backends]

    def sample(self) -> tuple[float, dict[str, float]]:
        """Row power now (every GPU plus each node's non-GPU power), and the GPU power of
        each priority class."""
        total = NON_GPU_W * len(self.backends)
        by_class: dict[str, float] = {}
        for backend, indices in self._gpus:
            for index in indices:
                sample = backend.sample(index)
                power_w = (sample.power_mw or 0) / 1000.0
                total += power_w
                cls = self.classes.get(index)
                if cls is not None:
                    by_class[cls] = by_class.get(cls, 0.0) + power_w
                    self.clocks.add(cls, sample.sm_clock_mhz, sample.gpu_util_pct)
        return total, by_class


async def _view(bus: MqttBus, view: DemoView, out: TextIO, *, tty: bool) -> None:
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


async def run_demo(  # noqa: PLR0915 - builds the whole row, one statement per part
    options: DemoOptions, *, out: TextIO = sys.stdout
) -> DemoView:
    """Run broker, aggregator, agents and the live view until the duration or a signal."""
    log = structlog.get_logger()
    stop = asyncio.Event()
    reload = asyncio.Event()
    aiokit.install_signal_handlers(stop, reload)
    if options.duration_s is not None:
        asyncio.get_running_loop().call_later(options.duration_s, stop.set)
    nodes = options.nodes
    budget_w = options.row_budget_w()
    async with contextlib.AsyncExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polca-demo-")))
        if options.broker is None:
            from polca.telemetry.broker import EmbeddedBroker  # noqa: PLC0415

            broker = await stack.enter_async_context(EmbeddedBroker(host="127.0.0.1", port=0))
            host, port = "127.0.0.1", broker.port
            out.write(f"embedded MQTT broker on {host}:{port}\n")
        else:
            host, port = options.broker
        mqtt = MqttSettings(host=host, port=port, reconnect_min_s=0.2)
        quiet = LoggingSettings(level="warning")
        replays = tenant_replays(options, Trace.load())
        agents = []
        shadows = []
        for number, (rack, node) in enumerate(nodes):
            shadows.append(_node_gpus(options, number, replays[number]))  # never capped
            backend = _node_gpus(options, number, replays[number])
            settings = Settings(
                mqtt=mqtt,
                logging=quiet,
                topics=TopicSettings(site=SITE, row=ROW, rack=rack, node=node),
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
            agents.append(
                Agent(settings, backend=backend, policy_store=PolicyStore(options.policy))
            )
        aggregator_settings = AggregatorSettings(
            mqtt=mqtt,
            logging=quiet,
            site=SITE,
            instance=AGGREGATOR_INSTANCE,
            policy_file=options.policy,
            state_dir=work / "aggregator",
            rows=(
                RowSpec(
                    name=ROW,
                    budget_w=budget_w,
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
        sink = make_sink(aggregator_settings.influx, state_dir=work / "aggregator")
        aggregator = Aggregator(aggregator_settings, sinks=[sink] if sink is not None else [])
        view = DemoView(options, budget_w)
        policy = load_policy(options.policy).policy
        view.clocks = ClassClocks(options.model)
        view.counterfactual = Counterfactual(
            shadows,
            _gpu_classes(policy, options.gpus_per_node),
            ClassClocks(options.model),
        )
        plants = [
            SimulatedCdu(
                f"cdu{r + 1}",
                loop=f"loop{r + 1}",
                ratings=CDU_RATINGS,
                seed=options.seed + r,
                heat_kw=10.0,
            )
            for r in range(options.racks)
        ]
        cdu_bus = MqttBus(mqtt, client_id="polca-demo-cdus")

        def rack_power(rack: str) -> Callable[[], dict[str, float]]:
            def power() -> dict[str, float]:
                summary = view.summary
                if summary is None:
                    return {}
                return {r.rack: r.power_w for r in summary.racks if r.rack == rack}

            return power

        view_bus = MqttBus(
            mqtt,
            client_id="polca-demo-view",
            subscriptions=[
                (f"polca/v1/{SITE}/{ROW}/summary", 0),
                (f"polca/v1/{SITE}/{ROW}/+/+/telemetry", 0),
                (f"polca/v1/{SITE}/{ROW}/+/+/events", 0),
                (f"polca/v1/{SITE}/aggregator/+/events", 0),
                (f"polca/v1/{SITE}/cooling/loop/+/state", 0),
                (f"polca/v1/{SITE}/cooling/loop/+/alarms", 1),
                (f"polca/v1/{SITE}/{ROW}/+/control", 0),
            ],
        )
        log.info(
            "demo_started",
            nodes=len(nodes),
            budget_w=round(budget_w),
            nameplate_w=round(options.nameplate_w()),
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(view_bus.run())
            view_task = tg.create_task(_view(view_bus, view, out, tty=out.isatty()))
            agg_task = tg.create_task(aggregator.run())
            agent_tasks = [tg.create_task(a.run()) for a in agents]
            tg.create_task(cdu_bus.run())
            plant_tasks = [
                tg.create_task(
                    run_plant(
                        cdu_bus,
                        plant,
                        site=SITE,
                        interval_s=1.0,
                        rack_power_w=rack_power(f"rack{r + 1}"),
                    )
                )
                for r, plant in enumerate(plants)
            ]
            if options.incident_at_s is not None and len(plants) > 1:
                loop = asyncio.get_running_loop()
                victim = plants[1]
                loop.call_later(options.incident_at_s, victim.fail_pump)
                loop.call_later(options.incident_at_s + options.incident_s, victim.restore_pump)
            await stop.wait()
            # Stop the controller first so agents don't fail-safe while stopping.
            aggregator.stop_requested.set()
            await agg_task
            for agent in agents:
                agent.stop_requested.set()
            await asyncio.gather(*agent_tasks)
            view_task.cancel()
            for task in plant_tasks:
                task.cancel()
            await cdu_bus.close(timeout_s=1.0)
            await view_bus.close(timeout_s=1.0)
        out.write(view.render())
        out.write(view.closing_summary())
        if options.record_dir is not None:
            paths = view.write_record(options.record_dir, policy.classes)
            out.write(f"recorded           : {', '.join(str(p) for p in paths)}\n")
        out.flush()
    return view
