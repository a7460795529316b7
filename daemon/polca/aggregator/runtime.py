"""The aggregator's shell: supervision, the clocks, the buses and the sinks.

Decisions live in ``core.py`` (``AggregatorCore``: what each received message and each
control step lead to), ``step.py`` (the control step) and ``connections.py`` (which
connection carries what, how the connections start and close); this module only moves
data between them, the clocks, the buses and the sinks, in the agent's shape: ``start()``,
``stop(clean=...)``, ``run()``. Start-up and shutdown: the package's docstring.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

from polca import aiokit, service
from polca.aggregator import connections
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.core import AggregatorCore
from polca.aggregator.step import StepResult
from polca.bmc.actuator import BmcActuator, Connector, OobOutcome
from polca.coord.etcd import Elector
from polca.exits import ExitRecord
from polca.export.sink import FanOut, Sink
from polca.policy import LoadedPolicy, PolicyStore
from polca.sdnotify import SystemdNotifier, WatchdogGate
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import Bus, BusFactory, InMessage, OutMessage

_Task = Coroutine[Any, Any, object]


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
        bmc_connector: Connector | None = None,
    ) -> None:
        self.settings = settings
        self.sinks = FanOut(sinks)
        self.notifier = notifier or SystemdNotifier()
        self.clock_ns = clock_ns  # wall clock: stamps only
        self.mono_ns = mono_ns  # receipt times, leases, write intervals, the step's now_s
        self.bus_factory = bus_factory
        self.log = structlog.get_logger().bind(aggregator=settings.instance)
        self.policy_store = PolicyStore(settings.policy_file)
        self.core = AggregatorCore(
            settings, policy_store=self.policy_store, epoch_ns=clock_ns(), log=self.log
        )
        self.rows, self.intake = self.core.rows, self.core.intake
        self.leadership, self.step_failures = self.core.leadership, self.core.step_failures
        self.exits = ExitRecord(settings.state_dir, clock_ns=clock_ns, logger=self.log)
        self.stop_requested = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.gate = WatchdogGate()
        self.bus: Bus | None = None  # the control connection (``start`` makes it)
        self.intake_buses: dict[str, Bus] = {}  # in only, by name (``intake_plan``)
        self.elector: Elector | None = None
        self.control_wake = asyncio.Event()  # step now (an urgent reading), not at the interval
        self.reloader = service.PolicyReloader(
            store=self.policy_store,
            notifier=self.notifier,
            log=self.log,
            status_line=self.core.status_line,
            on_rejected=lambda problems: self._publish(
                self.core.policy_rejected(problems, now_ns=self.clock_ns())
            ),
            on_changed=self._policy_changed,
        )
        self.bmc = (  # out-of-band caps: off without BMCs
            BmcActuator(settings.bmc, on_outcome=self._oob_outcome, connector=bmc_connector)
            if settings.bmc.nodes
            else None
        )

    @property
    def policy(self) -> LoadedPolicy:
        """The policy in force (the last good one)."""
        return self.core.policy

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Start, run until ``stop_requested`` is set, then shut down in order."""
        streak = self.exits.start_reporting(crash_loop_after=self.settings.control.crash_loop_after)
        self.core.crash_loop = streak.text if streak else None
        with self.exits.recording():
            await self.start()
            await self._supervise()

    async def start(self) -> None:
        """Start-up, up to the buses (made, not connected) and before the loops: ``run()``
        calls it, and a test that drives the loop bodies (``handle_message``,
        ``control_step``) itself, with ``MemoryBus``es, ending with ``stop()``."""
        s = self.settings
        self.policy_store.load_first()
        if not s.rows:
            self.log.warning("no_rows_configured", hint="add rows: to the configuration")
        self.bus, self.intake_buses = connections.make_buses(
            self.bus_factory,
            s,
            self.intake,
            will=self._status_message("offline", reason="connection lost"),
            birth=self._birth,
            clock_ns=self.clock_ns,
            mono_ns=self.mono_ns,
        )
        self.rows.start(self.mono_ns() / 1e9)
        self.elector = connections.elector(
            s, leadership=self.leadership, on_change=self.leadership_changed, mono_ns=self.mono_ns
        )
        self.log.info(
            "aggregator_started",
            rows=[r.name for r in s.rows],
            policy=self.policy.policy.name,
            revision=self.policy.revision,
            observe=s.control.observe,
            shard=s.shard if s.ha.enabled else None,
        )

    async def stop(self, *, clean: bool = True) -> None:
        """Shut down what ``start()`` opened, without the loops (for driven tests)."""
        await self._shutdown(clean=clean)

    async def _supervise(self) -> None:
        assert self.bus is not None  # noqa: S101 - made by start()
        self.notifier.ready(self.core.status_line())
        # Each received message is handled on arrival (``handle_message`` never raises):
        # no inbox to wait in, no task switch per message.
        conns = connections.tasks(
            self.bus, self.intake_buses, self.elector, handler=self.handle_message
        )
        extra: dict[str, _Task] = {"bmc": self.bmc.run()} if self.bmc is not None else {}
        await service.supervise(
            connections={**conns, "sinks": self.sinks.run()},
            loops={
                "control": aiokit.every_or_woken(
                    self.settings.control.interval_s, self.control_wake, self._control_tick
                ),
                **extra,
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
            shutdown=lambda clean: self._shutdown(clean=clean),
            log=self.log,
            stopping_event="aggregator_stopping",
        )

    async def _shutdown(self, *, clean: bool) -> None:
        """The package's shutdown order. Control messages stay retained: agents keep the
        last level until the lease ends, then apply their fail-safe caps."""
        bounds, log = service.STOP_BOUNDS, self.log
        self.notifier.stopping()
        if self.bmc is not None:  # caps in force stay: a restarted leader takes over
            close = self.bmc.close()
            await service.bounded(close, bounds.session_s, "bmc_sessions_not_closed", log)
        await connections.resign(self.elector, log)
        await self.sinks.close(timeout_s=bounds.sinks_s)
        final = self._status_message("offline", reason="stopped" if clean else "failed")
        await connections.close(self.bus, self.intake_buses, final=final, log=log)

    # ------------------------------------------------------------------ messages out

    def _publish(self, message: OutMessage | None) -> None:
        if self.bus is not None and message is not None:
            self.bus.publish_nowait(message)

    def _status_message(self, state: str, *, reason: str | None = None) -> OutMessage:
        # The endpoint is known before the bus says it is connected (the birth's status).
        at = self.bus.stats.endpoint if self.bus is not None else None
        return self.core.status_message(state, now_ns=self.clock_ns(), reason=reason, endpoint=at)

    def _publish_status(self) -> None:
        """The status now, when connected; otherwise the next connection's birth carries
        it (a status queued meanwhile would arrive after the birth's, naming no endpoint)."""
        if self.bus is not None and self.bus.connected.is_set():
            self._publish(self._status_message("online"))

    def _birth(self) -> list[OutMessage]:
        """What every new control connection publishes first: the status (naming the
        endpoint) and the policies."""
        return [self._status_message("online"), *self.core.policy_messages(now_ns=self.clock_ns())]

    def _event(self, name: str, **detail: object) -> None:
        self._publish(self.core.event(name, detail, now_ns=self.clock_ns()))

    # ------------------------------------------------------------------ intake

    def handle_message(self, message: InMessage) -> None:
        """Take one received message; carry out what follows from it. Never raises."""
        received_s = (message.received_mono_ns or self.mono_ns()) / 1e9
        writing, now_s = bool(self.sinks), self.mono_ns() / 1e9
        received = self.core.receive(message, received_s=received_s, now_s=now_s, writing=writing)
        try:
            for moved in received.moves:
                connections.resubscribe(self.intake_buses, moved)
                self._event(
                    f"node_{moved.kind}", row=moved.row, node=moved.node, connection=moved.shared
                )
            if received.wake:
                self.control_wake.set()
            for batch in received.writes:
                self.sinks.write(batch)
            if received.deposed is not None:
                # A newer leader exists: our lease is gone though we have not heard yet.
                self.log.warning("deposed", term=self.leadership.term, newer_term=received.deposed)
                self.leadership_changed()
        except Exception as exc:  # one message must never end the intake
            self.intake.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))

    def leadership_changed(self) -> None:
        """The elector saw a change: log and audit it, stamp the new term, step at once."""
        change = self.core.leadership_changed()
        self.log.info("leadership_changed", **change.detail)
        if change.lead_term is not None:
            self.control_wake.set()  # the first control of the new term goes out now
        if change.audit:
            self._event("leader_changed", **change.detail)
            if self.sinks:
                self.sinks.write([self.core.leader_point(change, now_ns=self.clock_ns())])
        self._publish_status()
        self.notifier.status(self.core.status_line())

    # ------------------------------------------------------------------ control

    def _control_tick(self) -> None:
        self.control_step(self.mono_ns() / 1e9)
        self.gate.beat()

    def control_step(self, now_s: float) -> StepResult | None:
        """Run one control step (``AggregatorCore.step``); publish and write what it
        decided. Never raises: a failed step publishes nothing and is retried."""
        self.core.rows.intake_cut(
            cut=connections.intake_cut(self.bus, self.intake_buses), now_s=now_s
        )
        stepped = self.core.step(now_s, now_ns=self.clock_ns(), now_mono_ns=self.mono_ns())
        if stepped is None:
            return None
        for message in stepped.messages:
            self._publish(message)
        if self.bmc is not None:
            for target in stepped.oob:
                self._log_line(*target.log_line())
                self.bmc.want(target)
        for decision in stepped.changed:
            self.log.info("level_changed", **decision.audit)
            self._event("level_changed", **decision.audit)
            self.notifier.status(self.core.status_line())
        if self.sinks:
            batch = self.core.step_points(
                stepped.result,
                sinks=self.sinks,
                now_s=now_s,
                connections=connections.stats(self.bus, self.intake_buses),
            )
            if batch is not None:
                self.sinks.write(batch)
        return stepped.result

    def _log_line(self, level: str, event: str, fields: dict[str, object]) -> None:
        getattr(self.log, level)(event, **fields)

    def _oob_outcome(self, outcome: OobOutcome) -> None:
        """One out-of-band write ended: log it, publish the event, write the point."""
        self._log_line(*outcome.log_line())
        event, point = self.core.oob_reported(outcome, now_ns=self.clock_ns())
        self._publish(event)
        if self.sinks:
            self.sinks.write([point])

    # ------------------------------------------------------------------ policy

    def reload_policy(self, *, trigger: str) -> bool:
        """Reload and, when valid and new, publish the node policy; never publish a bad one."""
        return self.reloader.reload(trigger=trigger)

    def _policy_changed(self) -> None:
        for message in self.core.policy_messages(now_ns=self.clock_ns()):
            self._publish(message)
        self._publish_status()
        self._event("policy_published", revision=self.policy.revision)
