"""The aggregator's supervisor: intake, the row controllers, policy publishing, the sink.

Start-up: load the policy (fatal if invalid) -> start the sink -> connect MQTT (retained
status with a Last Will; subscribe to the owned rows only) -> publish the node policy ->
systemd READY=1 -> loops. Tasks: ``mqtt`` (connect loop; outlives the rest so the final
status goes out), ``intake`` (route messages to rows), ``control`` (every interval: roll
up each row, run its ladder, publish leased control, the row summary and the points),
``policy_watcher`` and ``sighup`` (reload; an invalid edit is reported and never
published), ``sink`` (batched writes to InfluxDB), ``watchdog``.

During ``control.warmup_s`` after start, nothing is published until every node has
reported, so a restarted aggregator never uncaps a row for lack of data; retained control
left by its previous run seeds the ladders (see ``controller.py``), clamped into the
policy's levels.

Every received message is handled on its own inside the intake's guard (``intake.py``):
no payload, retained or not, can end a task. How each run ended is kept in
``state_dir/exits.json``; the same failure ending several runs in a row is reported as a
crash loop (log, systemd ``STATUS=``, the retained status message).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from polca import __version__, aiokit
from polca.aggregator import points
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.controller import ScopeController, ScopeDecision
from polca.aggregator.cooling import (
    CoolingStep,
    CoolingSupervisor,
    effective_rack_budgets,
    effective_row_budget_w,
)
from polca.aggregator.intake import Intake
from polca.aggregator.rollup import RowRollup, RowTracker
from polca.aggregator.sink import InfluxSink, Sink, resolve_token
from polca.errors import PolicyError
from polca.exits import ExitRecord, Streak
from polca.policy import LoadedPolicy, PolicyStore
from polca.sdnotify import SystemdNotifier, WatchdogGate
from polca.settings import InfluxSettings
from polca.telemetry.bus import MqttBus, OutMessage
from polca.telemetry.checks import ClockWindow, DropLog
from polca.telemetry.schema import (
    CduTelemetry,
    Control,
    CoolingAlarm,
    CoolingLoopState,
    Event,
    LoopAlarm,
    PolicyBundle,
    RackSummary,
    RowSummary,
    Status,
    Telemetry,
    encode,
)
from polca.telemetry.topics import Topics


@dataclass(frozen=True, slots=True)
class _Budgets:
    """A row's budgets at one control step: effective row budget, per-rack budgets."""

    row_w: float
    racks: Mapping[str, float]  # effective: min(electrical, thermal)
    thermal: Mapping[str, float]  # from the cooling loops
    rack_levels: Mapping[str, int]  # rack-scope levels published this step


def make_sink(influx: InfluxSettings, *, state_dir: Path) -> Sink | None:
    """The InfluxDB sink the settings ask for (spooling under ``state_dir``), or None."""
    if influx.url is None:
        return None
    if influx.spool_dir is None:
        influx = influx.model_copy(update={"spool_dir": state_dir / "spool"})
    return InfluxSink(influx, token=resolve_token(influx))


class Aggregator:
    """One aggregator process (construct, then ``await run()``)."""

    def __init__(
        self,
        settings: AggregatorSettings,
        *,
        sink: Sink | None = None,
        notifier: SystemdNotifier | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.settings = settings
        self.sink = sink
        self.notifier = notifier or SystemdNotifier()
        self.clock_ns = clock_ns
        self.topics = Topics(settings.topic_root)
        self.log = structlog.get_logger().bind(aggregator=settings.instance)
        self.policy_store = PolicyStore(settings.policy_file)
        self.trackers = {row.name: RowTracker(row) for row in settings.rows}
        self.epoch_ns = clock_ns()
        self.cooling = CoolingSupervisor(settings.cooling)
        self.controllers: dict[tuple[str, str | None], ScopeController] = {}
        for row in settings.rows:
            self.controllers[(row.name, None)] = self._controller(row.name, None)
            for rack in row.racks:
                on_loop = settings.cooling.loop_of(rack.name) is not None
                if rack.budget_w is not None or on_loop:
                    self.controllers[(row.name, rack.name)] = self._controller(row.name, rack.name)
        self._control_wake = asyncio.Event()
        self.intake = Intake(
            site=settings.site,
            topics=self.topics,
            trackers=self.trackers,
            issuer=settings.instance,
            on_telemetry=self._on_telemetry,
            on_event=self._on_event,
            on_retained_control=self._on_retained_control,
            on_cdu=self._on_cdu,
            cdus=tuple(loop.cdu for loop in settings.cooling.loops),
            window=ClockWindow.of_seconds(settings.control.clock_skew_tolerance_s),
        )
        self.meter_log = DropLog("meter_reading_implausible", logger=self.log)
        self.exits = ExitRecord(settings.state_dir, clock_ns=clock_ns, logger=self.log)
        self.crash_loop: Streak | None = None
        self.stop_requested = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.gate = WatchdogGate()
        self.bus: MqttBus | None = None
        self.started_s: float | None = None
        self.warm = False
        self.last_decisions: dict[tuple[str, str | None], ScopeDecision] = {}
        self.last_rollups: dict[str, RowRollup] = {}
        self._gpu_written_s: dict[str, float] = {}
        self._published_revision: str | None = None

    def _controller(self, row: str, rack: str | None) -> ScopeController:
        return ScopeController(
            site=self.settings.site,
            row=row,
            rack=rack,
            issuer=self.settings.instance,
            epoch_ns=self.epoch_ns,
        )

    @property
    def policy(self) -> LoadedPolicy:
        """The policy in force (the last good one)."""
        current = self.policy_store.current
        if current is None:
            msg = "no valid policy loaded"
            raise PolicyError(msg)
        return current

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Start, run until ``stop_requested``, then shut down in order."""
        self._note_start()
        with self.exits.recording():
            await self._run()

    def _note_start(self) -> None:
        """Record that a run begins; report a crash loop when the same failure repeats."""
        self.crash_loop = self.exits.start_reporting(
            crash_loop_after=self.settings.control.crash_loop_after
        )

    def _crash_loop_text(self) -> str | None:
        return None if self.crash_loop is None else self.crash_loop.text

    async def _run(self) -> None:
        result = self.policy_store.reload()
        if self.policy_store.current is None:
            problems = "; ".join(result.errors) or "unknown error"
            msg = f"policy {self.settings.policy_file} is invalid: {problems}"
            raise PolicyError(msg, problems=result.errors)
        if not self.settings.rows:
            self.log.warning("no_rows_configured", hint="add rows: to the configuration")
        self.bus = MqttBus(
            self.settings.mqtt,
            client_id=self.settings.mqtt.client_id or f"polca-aggregator-{self.settings.instance}",
            will=self._status_message("offline", reason="connection lost"),
            subscriptions=self.intake.subscriptions(),
            birth=self._birth,
            clock_ns=self.clock_ns,
        )
        self.started_s = asyncio.get_running_loop().time()
        self.notifier.ready(self._status_line())
        self.log.info(
            "aggregator_started",
            rows=[r.name for r in self.settings.rows],
            policy=self.policy.policy.name,
            revision=self.policy.revision,
            observe=self.settings.control.observe,
        )
        async with asyncio.TaskGroup() as outer:
            bus_task = outer.create_task(self.bus.run(), name="mqtt")
            sink_task = (
                outer.create_task(self.sink.run(), name="sink") if self.sink is not None else None
            )
            try:
                await aiokit.run_until_stopped(
                    {
                        "intake": self._intake(),
                        "control": self._control_loop(),
                        "policy_watcher": self._policy_watcher(),
                        "sighup": self._sighup(),
                        "watchdog": self._watchdog(),
                    },
                    self.stop_requested,
                )
                self.log.info("aggregator_stopping")
            finally:
                await asyncio.shield(self._shutdown(bus_task, sink_task))

    async def _shutdown(
        self, bus_task: asyncio.Task[None], sink_task: asyncio.Task[None] | None
    ) -> None:
        self.notifier.stopping()
        # Control messages stay retained: agents keep the last level until the lease ends,
        # then apply their fail-safe caps (a restarted aggregator takes over from them).
        if self.sink is not None:
            await self.sink.close(timeout_s=5.0)
        if sink_task is not None:
            sink_task.cancel()
        if self.bus is not None:
            try:
                async with asyncio.timeout(3.0):
                    await self.bus.close(final=[self._status_message("offline", reason="stopped")])
            except TimeoutError:
                self.log.warning("final_status_not_sent")
        bus_task.cancel()

    # ------------------------------------------------------------------ MQTT messages

    def _status_message(self, state: str, *, reason: str | None = None) -> OutMessage:
        current = self.policy_store.current
        status = Status(
            ts_ns=self.clock_ns(),
            state=state,
            node=self.settings.instance,
            agent_version=__version__,
            backend="aggregator",
            policy_name=current.policy.name if current else None,
            policy_revision=current.revision if current else None,
            started_ns=self.epoch_ns,
            reason=reason if reason is not None or state == "offline" else self._crash_loop_text(),
        )
        topic = self.topics.aggregator(self.settings.site, self.settings.instance, "status")
        return OutMessage(topic, encode(status), qos=1, retain=True)

    def _birth(self) -> list[OutMessage]:
        messages = [self._status_message("online")]
        messages.extend(self._policy_messages())
        return messages

    def _policy_messages(self) -> list[OutMessage]:
        if not self.settings.control.publish_policy:
            return []
        loaded = self.policy
        bundle = PolicyBundle(
            ts_ns=self.clock_ns(),
            name=loaded.policy.name,
            revision=loaded.revision,
            text=loaded.text,
            source=loaded.source[-512:],  # the wire bound; the end of a path says most
        )
        payload = encode(bundle)
        self._published_revision = loaded.revision
        return [
            OutMessage(
                self.topics.policy(self.settings.site, row.name), payload, qos=1, retain=True
            )
            for row in self.settings.rows
        ]

    def _aggregator_event(self, name: str, **detail: Any) -> None:
        try:
            event = Event(
                ts_ns=self.clock_ns(),
                seq=0,
                node=self.settings.instance,
                event=name,
                detail=detail,
            )
        except ValueError as exc:  # pydantic's ValidationError: a detail out of bounds
            self.log.warning("event_not_published", event_name=name, error=str(exc)[:400])
            return
        if self.bus is not None:
            topic = self.topics.aggregator(self.settings.site, self.settings.instance, "events")
            self.bus.publish_nowait(OutMessage(topic, encode(event), qos=1))

    def _status_line(self) -> str:
        levels = ", ".join(
            f"{row}={d.level_name}"
            for (row, rack), d in self.last_decisions.items()
            if rack is None
        )
        rows = len(self.settings.rows)
        loop = f"; {text}" if (text := self._crash_loop_text()) else ""
        return f"{rows} rows ({levels or 'warming up'}), policy {self.policy.revision}{loop}"

    # ------------------------------------------------------------------ intake

    async def _intake(self) -> None:
        assert self.bus is not None  # noqa: S101 - set before the loops start
        loop = asyncio.get_running_loop()
        while True:
            message = await self.bus.get()
            self.intake.handle(message, loop.time())

    def _on_telemetry(self, row: str, rack: str, node: str, telemetry: Telemetry) -> None:
        if self.sink is None:
            return
        now = time.monotonic()
        last = self._gpu_written_s.get(node)
        if last is not None and now - last < self.settings.influx.gpu_every_s:
            return  # per-GPU series are downsampled; node/rack/row series are not
        self._gpu_written_s[node] = now
        self.sink.write(points.gpu_points(telemetry, site=self.settings.site, row=row, rack=rack))

    def _on_event(self, row: str, rack: str, node: str, event: Event) -> None:
        if self.sink is not None:
            self.sink.write(
                [points.event_point(event, site=self.settings.site, row=row, rack=rack)]
            )

    def _on_retained_control(self, control: Control) -> None:
        if self.warm:
            return
        key = (control.row, control.rack)
        controller = self.controllers.get(key)
        if controller is not None:
            controller.seed(control, top_level=self.policy.policy.top_level)
            self.log.info(
                "control_seeded",
                row=control.row,
                rack=control.rack,
                seeded_level=controller.seeded_from,
                retained_level=control.level,
                seq=control.seq,
            )

    def _on_cdu(self, cdu: CduTelemetry, now_s: float) -> None:
        if not self.cooling.observe(cdu, now_s):
            return
        urgent = (
            cdu.status != "ok"
            or any(d.state != "ok" for d in cdu.leak_detectors)
            or any(p.state == "failed" for p in cdu.pumps)
        )
        if urgent:
            # Cooling emergencies do not wait for the next control interval.
            self._control_wake.set()

    # ------------------------------------------------------------------ control

    async def _control_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.control.interval_s
        next_t = loop.time() + interval
        while True:
            woken = await aiokit.wait_first(self._control_wake, max(0.0, next_t - loop.time()))
            self._control_wake.clear()
            if not woken:
                next_t = max(next_t + interval, loop.time())
            self.control_step(loop.time())
            self.gate.beat()

    def control_step(self, now_s: float) -> None:
        """Evaluate every owned row (and budgeted rack) once and publish the results."""
        ctl = self.settings.control
        now_ns = self.clock_ns()
        loaded = self.policy
        rollups = {
            name: tracker.rollup(
                now_s, stale_after_s=ctl.stale_after_s, meter_min_fraction=ctl.meter_min_fraction
            )
            for name, tracker in self.trackers.items()
        }
        self.last_rollups = rollups
        for rollup in rollups.values():
            if rollup.meter_rejected_w is not None:
                self.meter_log.drop(
                    "below_node_telemetry",
                    topic=rollup.row,
                    detail=f"meter {rollup.meter_rejected_w:.0f} W; computed "
                    f"{rollup.computed_power_w:.0f} W is used",
                )
        if not self.warm:
            elapsed = now_s - (self.started_s or now_s)
            if elapsed < ctl.warmup_s and not all(r.all_reported for r in rollups.values()):
                return
            self.warm = True
            # Power ramped up while nodes were still reporting in: not a trend.
            for tracker in self.trackers.values():
                tracker.history.clear()
            self.log.info(
                "aggregator_warm",
                after_s=round(elapsed, 2),
                levels={
                    f"{k[0]}/{k[1] or '-'}": c.ladder.level for k, c in self.controllers.items()
                },
            )
        out: list[points.Point] = []
        cooling = self._cooling_step(rollups, now_s, now_ns, loaded, out)
        for row in self.settings.rows:
            rollup = rollups[row.name]
            tracker = self.trackers[row.name]
            trend = tracker.trend_w_per_s(now_s, ctl.trend_window_s)
            thermal = cooling.rack_thermal_budget_w
            row_budget_w = effective_row_budget_w(
                row.budget_w, [r.name for r in row.racks], thermal
            )
            decision = self._decide(
                (row.name, None),
                power_w=rollup.power_w,
                budget_w=row_budget_w,
                now_s=now_s,
                now_ns=now_ns,
                trend=trend,
                loaded=loaded,
                inputs={
                    "power_source": rollup.power_source,
                    "stale_nodes": list(rollup.stale_nodes),
                    "offline_nodes": list(rollup.offline_nodes),
                    "provisioned_budget_w": row.budget_w,
                },
            )
            rack_budgets = effective_rack_budgets(
                {r.rack: r.budget_w for r in rollup.racks},
                {r.rack: thermal[r.rack] for r in rollup.racks if r.rack in thermal},
            )
            rack_levels: dict[str, int] = {}
            for rack in rollup.racks:
                budget = rack_budgets.get(rack.rack)
                if budget is None or (row.name, rack.rack) not in self.controllers:
                    continue
                rack_levels[rack.rack] = self._decide(
                    (row.name, rack.rack),
                    power_w=rack.power_w,
                    budget_w=budget,
                    now_s=now_s,
                    now_ns=now_ns,
                    trend=None,
                    loaded=loaded,
                    floor_level=cooling.forced_levels.get(rack.rack, 0),
                    floor_reason=self._cooling_reason(cooling, rack.rack),
                ).level
            budgets = _Budgets(row_budget_w, rack_budgets, thermal, rack_levels)
            self._publish_summary(rollup, decision, trend, now_ns, budgets)
            out.extend(self._row_points(rollup, decision, trend, now_ns, budgets))
        if self.sink is not None:
            out.append(self._aggregator_point(now_ns))
            self.sink.write(out)

    def _cooling_step(
        self,
        rollups: Mapping[str, RowRollup],
        now_s: float,
        now_ns: int,
        loaded: LoadedPolicy,
        out: list[points.Point],
    ) -> CoolingStep:
        """Assess every cooling loop; publish alarm events and loop state; add points."""
        rack_power_w = {r.rack: r.power_w for roll in rollups.values() for r in roll.racks}
        step = self.cooling.step(
            rack_power_w=rack_power_w, now_s=now_s, top_level=loaded.policy.top_level
        )
        site = self.settings.site
        for event in step.events:
            log = self.log.warning if event.action in ("raised", "escalated") else self.log.info
            log(
                "cooling_alarm",
                loop=event.loop,
                alarm=event.alarm,
                severity=event.severity,
                action=event.action,
                value=event.value,
                threshold=event.threshold,
                detail=event.detail,
            )
            if self.bus is not None:
                alarm = CoolingAlarm(
                    ts_ns=now_ns,
                    loop=event.loop,
                    alarm=event.alarm,
                    severity=event.severity,
                    action=event.action,
                    previous=event.previous,
                    value=event.value,
                    threshold=event.threshold,
                    text=event.text[:512],
                )
                topic = self.topics.loop_alarms(site, event.loop)
                self.bus.publish_nowait(OutMessage(topic, encode(alarm), qos=1))
            out.append(
                points.make_point(
                    "cooling_alarm",
                    ts_ns=now_ns,
                    tags={
                        "site": site,
                        "loop": event.loop,
                        "alarm": event.alarm,
                        "severity": event.severity,
                        "action": event.action,
                    },
                    fields=event.influx_fields(),
                )
            )
        for name, loop in step.loops.items():
            out.append(
                points.make_point(
                    "cooling_loop",
                    ts_ns=now_ns,
                    tags={"site": site, "loop": name, "cdu": loop.cdu},
                    fields=loop.influx_fields(),
                )
            )
            if self.bus is not None:
                state = CoolingLoopState(
                    ts_ns=now_ns,
                    loop=name,
                    cdu=loop.cdu,
                    racks=loop.racks,
                    heat_load_kw=loop.heat_load_kw,
                    heat_removed_kw=loop.heat_removed_kw,
                    capacity_kw=loop.capacity_kw,
                    headroom_kw=loop.headroom_kw,
                    supply_temp_c=loop.supply_temp_c,
                    return_temp_c=loop.return_temp_c,
                    flow_lpm=loop.flow_lpm,
                    flow_fraction=loop.flow_fraction,
                    thermal_budget_w=loop.thermal_budget_w,
                    severity=loop.worst_severity or "ok",
                    alarms=tuple(
                        LoopAlarm(alarm=a.alarm, severity=a.severity) for a in loop.alarms
                    ),
                    emergency=loop.emergency,
                    stale=loop.stale,
                    forced_levels=dict(loop.forced_levels),
                )
                topic = self.topics.loop_state(site, name)
                self.bus.publish_nowait(OutMessage(topic, encode(state), qos=1, retain=True))
        return step

    def _cooling_reason(self, step: CoolingStep, rack: str) -> str:
        loop_name = self.settings.cooling.loop_of(rack)
        loop = step.loops.get(loop_name) if loop_name else None
        if loop is None:
            return ""
        alarms = ", ".join(f"{a.alarm} {a.severity}" for a in loop.alarms)
        return f"cooling loop {loop_name}: {alarms or 'recovering'}"

    def _decide(
        self,
        key: tuple[str, str | None],
        *,
        power_w: float,
        budget_w: float,
        now_s: float,
        now_ns: int,
        trend: float | None,
        loaded: LoadedPolicy,
        inputs: dict[str, Any] | None = None,
        floor_level: int = 0,
        floor_reason: str = "",
    ) -> ScopeDecision:
        ctl = self.settings.control
        controller = self.controllers[key]
        decision = controller.step(
            floor_level=floor_level,
            floor_reason=floor_reason,
            power_w=power_w,
            budget_w=budget_w,
            policy=loaded.policy,
            revision=loaded.revision,
            now_s=now_s,
            now_ns=now_ns,
            lease_s=ctl.lease_s,
            observe=ctl.observe,
            trend_w_per_s=trend,
            inputs=inputs,
        )
        self.last_decisions[key] = decision
        row, rack = key
        topic = (
            self.topics.row_control(self.settings.site, row)
            if rack is None
            else self.topics.rack_control(self.settings.site, row, rack)
        )
        if self.bus is not None:
            self.bus.publish_nowait(OutMessage(topic, encode(decision.control), qos=1, retain=True))
        if decision.changed:
            self.log.info("level_changed", **decision.audit)
            self._aggregator_event("level_changed", **decision.audit)
            self.notifier.status(self._status_line())
            if self.sink is not None:
                self.sink.write(
                    [
                        points.make_point(
                            "event",
                            ts_ns=now_ns,
                            tags={
                                "site": self.settings.site,
                                "row": row,
                                "rack": rack or "",
                                "node": self.settings.instance,
                                "kind": "level_changed",
                            },
                            fields={
                                "text": f"{decision.level_name}: {decision.control.reason}",
                                "detail": json.dumps(decision.audit, sort_keys=True),
                            },
                        ),
                    ]
                )
        return decision

    def _publish_summary(
        self,
        rollup: RowRollup,
        decision: ScopeDecision,
        trend: float | None,
        now_ns: int,
        budgets: _Budgets,
    ) -> None:
        if self.bus is None:
            return
        summary = RowSummary(
            ts_ns=now_ns,
            row=rollup.row,
            issuer=self.settings.instance,
            power_w=rollup.power_w,
            power_source=rollup.power_source,
            budget_w=rollup.budget_w,
            effective_budget_w=budgets.row_w,
            level=decision.level,
            level_name=decision.level_name,
            thresholds_w=decision.thresholds_w,
            trend_w_per_s=trend,
            lease_expires_ns=decision.control.lease_expires_ns,
            observe=decision.control.observe,
            racks=tuple(
                RackSummary(
                    rack=r.rack,
                    power_w=r.power_w,
                    budget_w=budgets.racks.get(r.rack),
                    thermal_budget_w=budgets.thermal.get(r.rack),
                    level=budgets.rack_levels.get(r.rack, 0),
                    nodes_online=r.nodes_online,
                    nodes_stale=r.nodes_stale,
                    nodes_offline=r.nodes_offline,
                )
                for r in rollup.racks
            ),
            offline_nodes=rollup.offline_nodes,
            stale_nodes=rollup.stale_nodes,
        )
        topic = self.topics.row_summary(self.settings.site, rollup.row)
        self.bus.publish_nowait(OutMessage(topic, encode(summary), qos=0, retain=True))

    def _row_points(
        self,
        rollup: RowRollup,
        decision: ScopeDecision,
        trend: float | None,
        now_ns: int,
        budgets: _Budgets,
    ) -> list[points.Point]:
        site = self.settings.site
        thresholds = {f"threshold_{i + 1}_w": t for i, t in enumerate(decision.thresholds_w[:3])}
        out = [
            points.row_point(
                ts_ns=now_ns,
                site=site,
                row=rollup.row,
                power_w=rollup.power_w,
                computed_power_w=rollup.computed_power_w,
                measured_power_w=rollup.measured_power_w,
                budget_w=rollup.budget_w,
                effective_budget_w=budgets.row_w,
                power_pct=decision.power_pct,
                level=float(decision.level),
                trend_w_per_s=trend,
                nodes_online=float(len(rollup.fresh_nodes)),
                nodes_stale=float(len(rollup.stale_nodes)),
                nodes_offline=float(len(rollup.offline_nodes)),
                **thresholds,
            ),
            points.control_point_from(decision.control, site=site),
        ]
        tracker = self.trackers[rollup.row]
        now_s = asyncio.get_running_loop().time()
        for rack in rollup.racks:
            out.append(
                points.rack_point(
                    ts_ns=now_ns,
                    site=site,
                    row=rollup.row,
                    rack=rack.rack,
                    power_w=rack.power_w,
                    budget_w=budgets.racks.get(rack.rack),
                    thermal_budget_w=budgets.thermal.get(rack.rack),
                    nodes_online=float(rack.nodes_online),
                    nodes_stale=float(rack.nodes_stale),
                    nodes_offline=float(rack.nodes_offline),
                )
            )
        for view in tracker.nodes.values():
            health = view.health(now_s, self.settings.control.stale_after_s)
            t = view.telemetry
            out.append(
                points.node_point(
                    ts_ns=now_ns,
                    site=site,
                    row=rollup.row,
                    rack=view.rack,
                    node=view.spec.name,
                    gpu_power_w=t.node_gpu_power_w if t and health == "fresh" else None,
                    power_w=view.power_w(health),
                    energy_delta_j=t.node_energy_delta_j if t and health == "fresh" else None,
                    level=float(t.level) if t else None,
                    fail_safe=float(t.fail_safe) if t else None,
                    online=float(health == "fresh"),
                    stale=float(health == "stale"),
                    gpus=float(len(t.gpus)) if t else None,
                    gpus_lost=float(sum(1 for g in t.gpus if g.state == "lost")) if t else None,
                    tick_p99_ms=t.health.tick_p99_ms if t else None,
                    outbox_dropped=t.health.outbox_dropped if t else None,
                    control_rejected=t.health.control_rejected if t else None,
                )
            )
        return out

    def _aggregator_point(self, now_ns: int) -> points.Point:
        stats = self.sink.stats if self.sink is not None else None
        return points.aggregator_point(
            ts_ns=now_ns,
            site=self.settings.site,
            instance=self.settings.instance,
            messages_in=self.intake.messages_in,
            messages_dropped=sum(self.intake.dropped.values()),
            points_written=stats.points_written if stats else 0,
            points_dropped=stats.points_dropped if stats else 0,
            points_spooled=stats.points_spooled if stats else 0,
            spool_bytes=stats.spool_bytes if stats else 0,
            dropped=dict(self.intake.dropped),
        )

    # ------------------------------------------------------------------ policy

    async def _policy_watcher(self) -> None:
        await aiokit.watch_file(
            self.settings.policy_file,
            debounce_s=0.2,
            action=lambda: self.reload_policy(trigger="file_changed"),
        )

    async def _sighup(self) -> None:
        await aiokit.repeat_on(self.reload_requested, lambda: self.reload_policy(trigger="sighup"))

    def reload_policy(self, *, trigger: str) -> bool:
        """Reload and, when valid and new, publish the node policy; never publish a bad one."""
        self.notifier.reloading()
        try:
            result = self.policy_store.reload()
            if result.errors:
                self.log.error(
                    "policy_rejected",
                    trigger=trigger,
                    problems=list(result.errors),
                    revision_in_force=self.policy.revision,
                )
                self._aggregator_event(
                    "policy_rejected",
                    problems=list(result.errors)[:20],
                    revision_in_force=self.policy.revision,
                )
                return False
            if not result.changed:
                self.log.info("policy_unchanged", trigger=trigger, revision=self.policy.revision)
                return False
            self.log.info("policy_reloaded", trigger=trigger, revision=self.policy.revision)
            if self.bus is not None:
                for message in self._policy_messages():
                    self.bus.publish_nowait(message)
                self.bus.publish_nowait(self._status_message("online"))
            self._aggregator_event("policy_published", revision=self.policy.revision)
            return True
        finally:
            self.notifier.ready(self._status_line())

    async def _watchdog(self) -> None:
        await aiokit.feed_watchdog(
            self.notifier, self.gate, extra_stall_s=self.settings.control.interval_s
        )
