"""The aggregator's shell: intake, the control step, policy publishing, the sinks.

Decisions live in ``step.py`` (rollups, cooling, ladders), messages in ``messages.py``,
points in ``points.py``, the routing of each received message in ``intake.py``; this
module only moves data between them, the clocks, the bus and the sinks.

Start-up: note the run in the exit record -> load the policy (fatal if invalid) -> make
the buses (the control connection: retained status with a Last Will, the owned rows'
control in; the node connections: each node's telemetry, status and events on one of
``intake.connections``, so a node flooding the broker fills only its own connection's
queue and delays neither control nor most nodes; the sources' connection: meters and
CDUs) -> systemd READY=1 -> loops. Connections: ``mqtt`` (the control bus; outlives the
loops so the final status goes out), ``mqtt-nodes-N`` and ``mqtt-sources`` (every bus
hands each received message to ``handle_message`` on arrival, which never raises) and
``sinks`` (batched writes). Loops
(under ``aiokit.guard``): ``control`` (every interval, or at once on an urgent reading: a
row over its next threshold, a CDU emergency; a step that fails publishes nothing and is
retried from the last good state), and ``polca.service``'s side tasks (policy watcher,
SIGHUP: an invalid edit is reported and never published; the watchdog).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

from polca import aiokit, service
from polca.aggregator import messages, points
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.intake import (
    Accepted,
    EventIn,
    Intake,
    PeerControl,
    RetainedControl,
    TelemetryIn,
    Urgent,
    node_shard,
)
from polca.aggregator.step import RowControl, StepResult
from polca.coord.etcd import Elector, EtcdClient
from polca.coord.leadership import Leadership
from polca.errors import PolicyError
from polca.exits import ExitRecord
from polca.export import gpus
from polca.export.schedule import WriteSchedule
from polca.export.sink import FanOut, Sink
from polca.policy import LoadedPolicy, PolicyStore
from polca.sdnotify import SystemdNotifier, WatchdogGate
from polca.telemetry.bus import Bus, BusFactory, InMessage, MqttBus, OutMessage
from polca.telemetry.checks import ClockWindow, DropLog
from polca.telemetry.topics import Topics


class Aggregator:
    """One aggregator process (construct, then ``await run()``)."""

    def __init__(
        self,
        settings: AggregatorSettings,
        *,
        sinks: Sequence[Sink] = (),
        notifier: SystemdNotifier | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
        bus_factory: BusFactory = MqttBus,
    ) -> None:
        self.settings = settings
        self.sinks = FanOut(sinks)
        self.notifier = notifier or SystemdNotifier()
        self.clock_ns = clock_ns  # wall clock: stamps only
        self.mono_ns = mono_ns  # receipt times (staleness), as ``control_step``'s now_s
        self.bus_factory = bus_factory
        self.topics = Topics(settings.topic_root)
        self.log = structlog.get_logger().bind(aggregator=settings.instance)
        self.policy_store = PolicyStore(settings.policy_file)
        self.epoch_ns = clock_ns()
        self.rows = RowControl(settings, epoch_ns=self.epoch_ns, log=self.log)
        self.intake = Intake(
            site=settings.site,
            topics=self.topics,
            trackers=self.rows.trackers,
            issuer=settings.instance,
            cdus=tuple(loop.cdu for loop in settings.cooling.loops),
            peers=frozenset(settings.ha.peers) - {settings.instance},
            window=ClockWindow.of_seconds(settings.control.clock_skew_tolerance_s),
            limits=settings.intake,
        )
        self.exits = ExitRecord(settings.state_dir, clock_ns=clock_ns, logger=self.log)
        self.crash_loop: str | None = None
        self.stop_requested = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.gate = WatchdogGate()
        self.bus: Bus | None = None
        """The control connection: control, summaries, status and events out; our rows'
        control, meters and CDUs in (``start`` makes it)."""
        self.intake_buses: dict[str, Bus] = {}
        """The connections that only take messages in: ``nodes-N`` (each node's topics on
        one), ``sources`` (meters and CDUs), ``quarantine`` (nodes moved off theirs for
        flooding it)."""
        self.step_failures = DropLog("control_step_failed", every_s=60.0, logger=self.log)
        """Control steps that raised (logged with the traceback, at most once a minute)."""
        self.control_wake = asyncio.Event()
        """Set when the control step should run now (an urgent reading), not at the interval."""
        self.schedule = WriteSchedule(settings.influx.write_every_s)
        self.health_backlog = gpus.HealthBacklog()
        self.leadership = Leadership.standby() if settings.ha.enabled else Leadership()
        self.elector: Elector | None = None
        self._seen_leader: tuple[str | None, int] = (None, 0)
        self.reloader = service.PolicyReloader(
            store=self.policy_store,
            notifier=self.notifier,
            log=self.log,
            status_line=self._status_line,
            on_rejected=lambda problems: self._event(
                "policy_rejected",
                problems=[p[:1000] for p in problems[:20]],
                revision_in_force=self.policy.revision,
            ),
            on_changed=self._policy_changed,
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
        streak = self.exits.start_reporting(crash_loop_after=self.settings.control.crash_loop_after)
        self.crash_loop = streak.text if streak else None
        with self.exits.recording():
            self.start(self.mono_ns() / 1e9)
            assert self.bus is not None  # noqa: S101 - made by start()
            self.notifier.ready(self._status_line())
            # Each received message is handled on arrival (``handle_message`` never raises):
            # no inbox to wait in, no task switch per message.
            self.bus.set_handler(self.handle_message)
            connections: dict[str, Coroutine[Any, Any, object]] = {
                "mqtt": self.bus.run(),
                "sinks": self.sinks.run(),
            }
            for name, bus in self.intake_buses.items():
                bus.set_handler(self.handle_message)
                connections[f"mqtt-{name}"] = bus.run()
            if self.elector is not None:
                connections["etcd"] = self.elector.run()
            await service.supervise(
                connections=connections,
                loops={
                    "control": self._control_loop(),
                    **service.side_tasks(
                        policy_file=self.settings.policy_file,
                        debounce_s=0.2,
                        reload=lambda trigger: self.reload_policy(trigger=trigger),
                        reload_requested=self.reload_requested,
                        notifier=self.notifier,
                        gate=self.gate,
                        extra_stall_s=self.settings.control.interval_s,
                    ),
                },
                stop=self.stop_requested,
                shutdown=lambda _clean: self.stop(),
                log=self.log,
                stopping_event="aggregator_stopping",
            )

    def start(self, now_s: float) -> None:
        """Load the policy and make the bus (not connected): start-up before the loops.

        ``run()`` calls it; a test that drives the loop bodies itself (``handle_message``,
        ``control_step``) calls it, connects a ``MemoryBus`` and ends with ``stop()``.
        """
        result = self.policy_store.reload()
        if self.policy_store.current is None:
            problems = "; ".join(result.errors) or "unknown error"
            msg = f"policy {self.settings.policy_file} is invalid: {problems}"
            raise PolicyError(msg, problems=result.errors)
        if not self.settings.rows:
            self.log.warning("no_rows_configured", hint="add rows: to the configuration")
        client_id = self.settings.mqtt.client_id or f"polca-aggregator-{self.settings.instance}"
        # Control, meters and CDUs on one connection, the nodes' topics on others: the broker
        # queues per connection, so a node flooding its topics delays neither the control
        # this one publishes (nor its acknowledgements and keepalive) nor most other nodes.
        self.bus = self.bus_factory(
            self.settings.mqtt,
            client_id=client_id,
            will=self._status_message("offline", reason="connection lost"),
            subscriptions=self.intake.subscriptions(),
            birth=lambda: [self._status_message("online"), *self._policy_messages()],
            clock_ns=self.clock_ns,
            mono_ns=self.mono_ns,
        )
        shards = self.intake.node_subscriptions(self.settings.intake.connections)
        shards["sources"] = self.intake.source_subscriptions()
        self.intake_buses = {
            name: self.bus_factory(
                self.settings.mqtt,
                client_id=f"{client_id}-{name}",
                subscriptions=subscriptions,
                clock_ns=self.clock_ns,
                mono_ns=self.mono_ns,
            )
            for name, subscriptions in shards.items()
            if subscriptions or name == "quarantine"
        }
        self.rows.start(now_s)
        ha = self.settings.ha
        if ha.enabled:
            client = EtcdClient(
                ha.etcd_endpoints,
                timeout_s=ha.request_timeout_s,
                username=ha.username,
                password=ha.secret(),
                ca_file=ha.tls_ca_file,
                cert_file=ha.tls_cert_file,
                key_file=ha.tls_key_file,
            )
            self.elector = Elector(
                client=client,
                key=f"{ha.key_prefix}/{self.settings.site}/{self.settings.shard}",
                instance=self.settings.instance,
                leadership=self.leadership,
                ttl_s=ha.lease_ttl_s,
                poll_s=ha.campaign_interval_s,
                on_change=self.leadership_changed,
                mono_ns=self.mono_ns,
            )
        self.log.info(
            "aggregator_started",
            rows=[r.name for r in self.settings.rows],
            policy=self.policy.policy.name,
            revision=self.policy.revision,
            observe=self.settings.control.observe,
            shard=self.settings.shard if ha.enabled else None,
        )

    async def stop(self) -> None:
        """Resign the lead, close the sinks and the bus (final ``offline`` status), bounded."""
        self.notifier.stopping()
        if self.elector is not None:
            try:
                async with asyncio.timeout(2.0):
                    await self.elector.resign()  # a standby leads at its next campaign
            except TimeoutError:
                self.log.warning("leadership_not_resigned")
            await self.elector.client.close()
        # Control messages stay retained: agents keep the last level until the lease ends,
        # then apply their fail-safe caps (a restarted aggregator takes over from them).
        await self.sinks.close(timeout_s=5.0)
        for bus in self.intake_buses.values():
            try:
                async with asyncio.timeout(1.0):
                    await bus.close()
            except TimeoutError:
                self.log.warning("intake_connection_not_closed")
        if self.bus is not None:
            try:
                async with asyncio.timeout(3.0):
                    await self.bus.close(final=[self._status_message("offline", reason="stopped")])
            except TimeoutError:
                self.log.warning("final_status_not_sent")

    # ------------------------------------------------------------------ messages out

    def _publish(self, message: OutMessage | None) -> None:
        if self.bus is not None and message is not None:
            self.bus.publish_nowait(message)

    def _status_message(self, state: str, *, reason: str | None = None) -> OutMessage:
        s = self.settings
        return messages.status(
            self.topics,
            site=s.site,
            instance=s.instance,
            state=state,
            loaded=self.policy_store.current,
            started_ns=self.epoch_ns,
            now_ns=self.clock_ns(),
            reason=reason,
            crash_loop=self.crash_loop,
            ha=self._ha_status() if s.ha.enabled else None,
        )

    def _ha_status(self) -> dict[str, object]:
        lead = self.leadership
        return {
            "shard": self.settings.shard,
            "role": lead.role,
            "term": lead.term if lead.role == "leader" else lead.leader_term,
            "leader": lead.leader,
        }

    def _policy_messages(self) -> list[OutMessage]:
        if not self.settings.control.publish_policy:
            return []
        return messages.policy_bundles(
            self.topics,
            site=self.settings.site,
            rows=[row.name for row in self.settings.rows],
            loaded=self.policy,
            now_ns=self.clock_ns(),
        )

    def _event(self, name: str, **detail: object) -> None:
        s = self.settings
        self._publish(
            messages.event(
                self.topics,
                site=s.site,
                instance=s.instance,
                name=name,
                detail=detail,
                now_ns=self.clock_ns(),
            )
        )

    def _status_line(self) -> str:
        levels = ", ".join(f"{row}={name}" for row, name in self.rows.row_levels().items())
        loop = f"; {self.crash_loop}" if self.crash_loop else ""
        revision = self.policy.revision
        return f"{len(self.settings.rows)} rows ({levels or 'warming up'}), policy {revision}{loop}"

    # ------------------------------------------------------------------ intake

    def handle_message(self, message: InMessage) -> None:
        """Take one received message; what the intake accepted goes on. Never raises."""
        now_s = (message.received_mono_ns or self.mono_ns()) / 1e9
        accepted = self.intake.handle(message, now_s)
        try:
            if accepted is None:
                for row, node in self.intake.take_quarantined():
                    self._quarantine(row, node)
            else:
                self._route(accepted)
        except Exception as exc:  # one message must never end the intake
            self.intake.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))

    def _route(self, accepted: Accepted) -> None:
        site = self.settings.site
        if isinstance(accepted, TelemetryIn):
            if accepted.urgent:
                self.control_wake.set()  # over the next threshold: escalate now
            if not self.sinks or self.leadership.role == "standby":
                return  # a standby writes no series of the rows: the leader does
            t = accepted.telemetry
            now_s = self.mono_ns() / 1e9
            # Health counters come on change and every agent.health_every_s; those within
            # the node's gpu_health interval wait for its next due message (never lost).
            if self.health_backlog.add(t) and self.schedule.due("gpu_health", accepted.node, now_s):
                health = self.health_backlog.take(accepted.node)
                self.sinks.write(
                    gpus.gpu_health_points(
                        t, site=site, row=accepted.row, rack=accepted.rack, health=health
                    )
                )
            if not self.schedule.due("gpu", accepted.node, now_s):
                return  # per-GPU series are thinned to their write interval
            self.sinks.write(gpus.gpu_points(t, site=site, row=accepted.row, rack=accepted.rack))
        elif isinstance(accepted, EventIn):
            if self.sinks:
                point = points.event_point(
                    accepted.event, site=site, row=accepted.row, rack=accepted.rack
                )
                self.sinks.write([point])
        elif isinstance(accepted, Urgent):
            self.control_wake.set()  # the row meter crossed the next threshold
        elif isinstance(accepted, RetainedControl):
            self.rows.seed(accepted.control, top_level=self.policy.policy.top_level)
        elif isinstance(accepted, PeerControl):
            self._peer_control(accepted)
        elif self.rows.observe_cdu(accepted.cdu, accepted.received_s):
            self.control_wake.set()  # cooling emergencies do not wait for the interval

    def _quarantine(self, row: str, node: str) -> None:
        """Move a flooding node's topics from its shared connection to the quarantine one:
        the broker's queue of the connection it shared drains, the other nodes' readings
        get through again; its own still count, through its own connection."""
        connections = self.settings.intake.connections
        shared = node_shard(node, connections)
        shards = self.intake.node_subscriptions(connections)
        for name in (shared, "quarantine"):
            bus = self.intake_buses.get(name)  # none before start()
            if bus is not None:
                bus.resubscribe(shards[name])
        self._event("node_quarantined", row=row, node=node, connection=shared)

    # ------------------------------------------------------------------ leadership

    def _peer_control(self, peer: PeerControl) -> None:
        """Another instance of the shard published control: follow it, or step down."""
        control = peer.control
        if self.leadership.role == "leader":
            if control.term > self.leadership.term and not peer.retained:
                # A newer leader exists: our lease is gone though we have not heard yet.
                self.log.warning("deposed", term=self.leadership.term, newer_term=control.term)
                self.leadership.lost()
                self.leadership_changed()
            return
        if control.term >= self.leadership.leader_term or peer.retained:
            self.rows.follow(control, top_level=self.policy.policy.top_level)

    def leadership_changed(self) -> None:
        """The elector saw a change: log and audit it, stamp the new term, step at once."""
        lead = self.leadership
        seen = (lead.leader, lead.leader_term)
        detail = {
            "shard": self.settings.shard,
            "role": lead.role,
            "term": lead.term,
            "leader": lead.leader,
            "leader_term": lead.leader_term,
        }
        self.log.info("leadership_changed", **detail)
        if lead.role == "leader":
            self.rows.set_term(lead.term)
            self.control_wake.set()  # the first control of the new term goes out now
        if seen != self._seen_leader:
            self._seen_leader = seen
            self._event("leader_changed", **detail)
            if self.sinks:
                self.sinks.write(
                    [
                        points.leader_point(
                            site=self.settings.site,
                            instance=self.settings.instance,
                            ts_ns=self.clock_ns(),
                            shard=self.settings.shard,
                            role=lead.role,
                            term=lead.term,
                            leader=lead.leader,
                            leader_term=lead.leader_term,
                        )
                    ]
                )
        self._publish(self._status_message("online"))
        self.notifier.status(self._status_line())

    # ------------------------------------------------------------------ control

    async def _control_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.control.interval_s
        next_t = loop.time() + interval
        while True:
            woken = await aiokit.wait_first(self.control_wake, max(0.0, next_t - loop.time()))
            self.control_wake.clear()
            if not woken:
                next_t = max(next_t + interval, loop.time())
            self.control_step(self.mono_ns() / 1e9)
            self.gate.beat()

    def control_step(self, now_s: float) -> StepResult | None:
        """Evaluate every owned row (and rack scope) once; publish and write the results.

        Never raises: a step that fails (whatever the input) is logged with its traceback,
        counted (``control_step_failed``), undone (``RowControl.restore``) and publishes
        nothing, not even part of its messages; the next interval tries again from the
        last good state. Points are built apart, so a failure there loses points only.
        """
        checkpoint = self.rows.checkpoint()
        try:
            result = self.rows.step(now_s, self.clock_ns(), self.policy)
            if result is None:
                return None  # warming up
            s = self.settings
            # Only the leader publishes control and writes the rows' points; a standby
            # decides as well (its ladders stay warm, corrected by the leader's messages).
            leading = self.leadership.may_publish(self.mono_ns())
            out: list[OutMessage] = []
            changed = []
            if leading:
                out = list(
                    messages.step_messages(
                        self.topics, site=s.site, issuer=s.instance, result=result
                    )
                )
                changed = [d for _scope, d in result.decisions() if d.changed]
        except Exception as exc:  # no input may stop the control loop
            self.rows.restore(checkpoint)
            self.step_failures.drop(type(exc).__name__, exc=exc, topic="", detail=repr(exc))
            return None
        for message in out:
            self._publish(message)
        for decision in changed:
            self.log.info("level_changed", **decision.audit)
            self._event("level_changed", **decision.audit)
            self.notifier.status(self._status_line())
        if self.sinks:
            try:
                self._write_step_points(result, now_s)
            except Exception as exc:  # points are not worth a control step
                self.step_failures.drop("points", exc=exc, topic="", detail=repr(exc))
        return result

    def _write_step_points(self, result: StepResult, now_s: float) -> None:
        s = self.settings
        # Points need no fencing: a leader cut off from etcd still writes them.
        writes = self.leadership.role != "standby"
        out = points.step_points(result, site=s.site, instance=s.instance) if writes else []
        out.append(
            points.aggregator_point_of(
                self.intake,
                self.sinks.stats,
                site=s.site,
                instance=s.instance,
                ts_ns=result.now_ns,
                step_failures=self.step_failures.total,
            )
        )
        # One decision per measurement and step: a step writes all its series or none.
        due = {m: self.schedule.due(m, "", now_s) for m in {p.measurement for p in out}}
        self.sinks.write([p for p in out if due[p.measurement]])

    # ------------------------------------------------------------------ policy

    def reload_policy(self, *, trigger: str) -> bool:
        """Reload and, when valid and new, publish the node policy; never publish a bad one."""
        return self.reloader.reload(trigger=trigger)

    def _policy_changed(self) -> None:
        for message in self._policy_messages():
            self._publish(message)
        self._publish(self._status_message("online"))
        self._event("policy_published", revision=self.policy.revision)
