"""The demo's live view and closing summary, fed by the row's MQTT messages.

``DemoView`` consumes what the row publishes (row summaries, node telemetry and events,
control, cooling loop states and alarms), samples the uncapped counterfactual
(``counterfactual.py``) at the agents' interval and takes its 1 s means, and renders: the
live view as text once a second, the closing summary (time at each level, brake and
capping events, peak power against the budget, what polca buys), and the run's record for
``--record`` (``row.csv``, ``uncapped.csv``: a power history ``polca plan --history``
reads). It decides nothing and starts nothing; the runtime (``runtime.py``) feeds it.
"""

from __future__ import annotations

import csv
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from polca.demo.counterfactual import ClassClocks, Counterfactual
from polca.demo.options import ROW, DemoOptions
from polca.telemetry.messages import InMessage
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

__all__ = ["RECORD_MAX", "DemoView"]

RECORD_MAX: Final = 86_400
"""Seconds of row and uncapped power a run keeps for ``--record`` (the last day at 1 Hz)."""


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
    feed_b_lost: bool = False  # set by the feeds' publisher (demo/feeds.py)
    feed_loss_s: int = 0  # row summaries with feed B down (one a second)
    feed_loss_budget_w: float | None = None  # the row's electrical budget meanwhile
    feed_loss_peak_pct: float = 0.0  # the row's power, % of that budget, at its highest
    feed_loss_over_s: int = 0  # summaries with the row above that budget
    feed_loss_levels: Counter[str] = field(default_factory=Counter)
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
        self.peak_pct = max(self.peak_pct, 100.0 * summary.power_w / self.budget_w)
        self.level_s[summary.level_name or str(summary.level)] += 1
        self.row_record.append(
            (
                self._since_start_s(),
                summary.power_w,
                summary.level,
                summary.level_name or str(summary.level),
            )
        )
        if summary.feeds.get("B") is False:
            budget_w = summary.electrical_budget_w or summary.effective_budget_w
            self.feed_loss_s += 1
            self.feed_loss_budget_w = budget_w
            self.feed_loss_peak_pct = max(self.feed_loss_peak_pct, pct)
            self.feed_loss_over_s += summary.power_w > budget_w
            self.feed_loss_levels[summary.level_name or str(summary.level)] += 1
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
        if s.feeds:
            feeds = ", ".join(f"{name} {'up' if up else 'DOWN'}" for name, up in s.feeds.items())
            lines.append(
                f"  feeds {feeds}; budget {(s.electrical_budget_w or s.budget_w) / 1000:.1f} kW "
                f"from {s.budget_origin}"
            )
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
        if self.feed_loss_s and self.feed_loss_budget_w is not None:
            level, _ = self.feed_loss_levels.most_common(1)[0]
            lines.append(
                f"feed B lost        : {self.feed_loss_s} s on feed A alone, the budget cut to "
                f"{self.feed_loss_budget_w / 1000:.1f} kW (from {self.budget_w / 1000:.1f}); "
                f"the row peaked at {self.feed_loss_peak_pct:.0f}% of it and was above it "
                f"{self.feed_loss_over_s} s, mostly at {level}"
            )
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
