"""The node agent's shell: one TaskGroup owning every loop, ordered start and stop.

Decisions live in ``core.py``; the GPU round trips are ``driver.py``'s, the telemetry loop
``publisher.py``'s, the broker-silence watch ``silence.py``'s, the assignment source
``assign/sources.py``'s. This module starts the tasks, moves messages between the bus and
the core and emits the effects the core returns. Start-up and shutdown: the package's
docstring.

Tasks (all under ``aiokit.guard``): ``mqtt`` (the bus; outlives the rest so the final
status goes out), ``sampler``, ``controller`` (woken by each tick, accepted control message
and policy change), ``publisher``, ``sinks`` (when any), ``broker-silence`` and
``assignment`` (when configured), and ``polca.service``'s side tasks. The bus hands each
received message to ``handle_message`` on arrival (``core.receive`` never raises).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

from polca import aiokit, service
from polca.agent import messages, policy_copy, silence
from polca.agent.actuator import ApplyResult
from polca.agent.config import Settings
from polca.agent.core import AgentCore
from polca.agent.driver import GpuDriver
from polca.agent.gpus import NodeGpus
from polca.agent.plans import Effects, Received
from polca.agent.publisher import TelemetryPublisher
from polca.assign.model import AssignmentUpdate
from polca.assign.rules import gpu_keys
from polca.assign.sources import task_for
from polca.exits import ExitRecord
from polca.export.sink import FanOut, Sink
from polca.gpu.backend import GpuBackend
from polca.gpu.threaded import ThreadedGpu
from polca.policy import PolicyStore
from polca.sdnotify import SystemdNotifier, WatchdogGate
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import Bus, BusFactory, InMessage, OutMessage
from polca.telemetry.topics import NodeAddress, Topics


class Agent:
    """One node agent process (construct, then ``await run()``)."""

    def __init__(
        self,
        settings: Settings,
        *,
        backend: GpuBackend,
        policy_store: PolicyStore,
        notifier: SystemdNotifier | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
        bus_factory: BusFactory = MqttBus,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.settings = settings
        self.sinks = FanOut(sinks)
        self.policy_store = policy_store
        self.notifier = notifier or SystemdNotifier()
        self.clock_ns = clock_ns  # wall clock: stamps and display only
        self.mono_ns = mono_ns  # leases, grace, every duration
        self.bus_factory = bus_factory
        t, a = settings.topics, settings.agent
        self.log = structlog.get_logger().bind(node=t.node)
        self.core = AgentCore(
            addr=NodeAddress(t.site, t.row, t.rack, t.node),
            topics=Topics(t.root),
            settings=a,
            policy_store=policy_store,
            identity=messages.Identity(settings.gpu.backend, a.observe_only, clock_ns()),
            assignment_source=settings.assignment.source,
        )
        self._status_topic = self.core.topics.node(self.core.addr, "status")
        gpu = ThreadedGpu(backend, call_timeout_s=settings.gpu.call_timeout_s)
        self.gpus = NodeGpus(gpu, state_dir=a.state_dir, observe_only=a.observe_only, log=self.log)
        self.exits = ExitRecord(a.state_dir, clock_ns=clock_ns, logger=self.log)
        self.gate = WatchdogGate()
        self.reload_requested = asyncio.Event()
        self.stop_requested = asyncio.Event()
        self.started_mono_ns = mono_ns()
        self.bus: Bus | None = None
        self.driver = GpuDriver(
            self.core, self.gpus, carry_out=self._carry_out, clock_ns=clock_ns, mono_ns=mono_ns
        )
        self.telemetry = TelemetryPublisher(
            self.core,
            self.gpus,
            sinks=self.sinks,
            site=t.site,
            carry_out=self._carry_out,
            bus_stats=lambda: self.bus.stats if self.bus is not None else None,
            clock_ns=clock_ns,
            mono_ns=mono_ns,
            log=self.log,
        )
        self._wake = asyncio.Event()
        self.reloader = service.PolicyReloader(
            store=policy_store,
            notifier=self.notifier,
            log=self.log,
            status_line=self.core.status_line,
            on_rejected=lambda problems: self._carry_out(
                self.core.policy_rejected(problems, now_ns=self.clock_ns())
            ),
            on_changed=self._policy_changed,
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Start, run until ``stop_requested`` is set, then shut down in order."""
        streak = self.exits.start_reporting(crash_loop_after=self.settings.agent.crash_loop_after)
        if streak is not None:
            self.core.crash_loop = streak.text
            self.notifier.status(streak.text)
        with self.exits.recording():
            try:
                await self.start()
                await self._supervise()
            finally:
                await self.gpus.close(self.settings.agent.stop_timeout_s)

    async def start(self) -> None:
        """Start-up, up to the bus (made, not connected) and before the loops: ``run()``
        calls it, and a test that drives the loop bodies (``tick``, ``handle_message``,
        ``control_step``) itself, with a ``MemoryBus``, ending with ``stop()``."""
        await self.driver.take_over(
            self.settings.agent,
            policy_store=self.policy_store,
            started_mono_ns=self.started_mono_ns,
            log=self.log,
        )
        self.telemetry.start()
        self.bus = self.bus_factory(
            self.settings.mqtt,
            client_id=self.settings.mqtt.client_id or f"polca-agent-{self.core.addr.node}",
            will=self._status_message("offline", reason="connection lost"),
            subscriptions=self.core.subscriptions(),
            birth=self._birth,
            clock_ns=self.clock_ns,
            mono_ns=self.mono_ns,
        )

    async def stop(self, *, clean: bool = True) -> None:
        """Shut down what ``start()`` opened, without the loops (for driven tests)."""
        await self._shutdown(clean=clean)
        await self.gpus.close(self.settings.agent.stop_timeout_s)

    async def _supervise(self) -> None:
        assert self.bus is not None  # noqa: S101 - made by start()
        self.notifier.ready(self.core.status_line())
        a = self.settings.agent
        # Each received message is handled on arrival (``handle_message`` never raises): a
        # control message reaches the controller without waiting in a queue for a task.
        self.bus.set_handler(self.handle_message)
        await service.supervise(
            connections={"mqtt": self.bus.run()},
            loops={
                "sampler": aiokit.every(a.sample_interval_s, self.tick),
                "controller": self._controller(),
                "publisher": aiokit.every(
                    a.publish_interval_s,
                    self.telemetry.once,
                    first_after_s=a.publish_interval_s,
                ),
                **({"sinks": self.sinks.run()} if self.sinks else {}),
                **self._optional_tasks(),
                **service.side_tasks(
                    policy_file=a.policy_file,
                    debounce_s=a.policy_reload_debounce_s,
                    reload=lambda trigger: self.reload_policy(trigger=trigger),
                    reload_requested=self.reload_requested,
                    notifier=self.notifier,
                    gate=self.gate,
                ),
            },
            stop=self.stop_requested,
            shutdown=lambda clean: self._shutdown(clean=clean),
            log=self.log,
            stopping_event="agent_stopping",
        )

    async def _shutdown(self, *, clean: bool) -> None:
        """Leave the GPUs as the stop requires, publish the final state and status; bounded."""
        self.notifier.stopping()
        if self.bus is not None:
            self.bus.set_handler(None)  # stopping: no message starts another control step
        reason = await self.driver.leave(clean=clean, timeout_s=self.settings.agent.stop_timeout_s)
        bounds = service.STOP_BOUNDS
        if self.bus is not None:
            close = self.bus.close(final=[self._status_message("offline", reason=reason)])
            await service.bounded(close, bounds.final_messages_s, "final_status_not_sent", self.log)
        if self.sinks:
            await self.sinks.close(timeout_s=bounds.sinks_s)

    # ------------------------------------------------------------------ effects out

    def _carry_out(self, effects: Effects) -> None:
        """Emit what the core asked for: its log lines, its messages, systemd's status."""
        for line in effects.logs:
            getattr(self.log, line.level)(line.event, **line.fields)
        connected = self.bus is not None and self.bus.connected.is_set()
        for message in effects.to_send(status_topic=self._status_topic, connected=connected):
            if self.bus is not None:  # before the bus exists (start-up): nowhere to go
                self.bus.publish_nowait(message)
        if effects.status_line is not None:
            self.notifier.status(effects.status_line)

    def _status_message(self, state: str, *, reason: str | None = None) -> OutMessage:
        return self.core.status_message(state, now_ns=self.clock_ns(), reason=reason)

    def _birth(self) -> list[OutMessage]:
        endpoint = self.bus.stats.endpoint if self.bus is not None else None
        return self.core.birth(endpoint, now_ns=self.clock_ns(), now_mono_ns=self.mono_ns())

    # ------------------------------------------------------------------ loops

    async def tick(self) -> None:
        """One sampling tick: read every GPU, then wake the controller."""
        start = time.perf_counter()
        samples = await self.driver.sample()
        self.telemetry.sampled(samples.values(), duration_s=time.perf_counter() - start)
        self._wake.set()

    async def _controller(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.control_step()
            self.gate.beat()

    async def control_step(self) -> ApplyResult | None:
        """One control step (``driver.py``); what its writes did (None: nothing written)."""
        return await self.driver.step()

    def handle_message(self, message: InMessage) -> None:
        """Act on one received message; count and drop a bad one. Never raises."""
        received = self.core.receive(message)
        if received.policy_copy is not None:
            policy_copy.save(self.settings.agent, received.policy_copy, self.log)
        self._take(received)

    # ------------------------------------------------------------------ assignment

    def assigned(self, update: AssignmentUpdate) -> None:
        """Take an assignment source's update (the MQTT one comes as a message)."""
        self._take(self.core.assign(update, now_mono_ns=self.mono_ns(), now_ns=self.clock_ns()))

    def _take(self, received: Received) -> None:
        self._carry_out(received.effects)
        if received.wake:
            self._wake.set()

    def _optional_tasks(self) -> dict[str, Coroutine[Any, Any, object]]:
        """The configured assignment source's task (``assign/sources.py``) and, with several
        broker endpoints, the loop that leaves a silent one (``silence.py``)."""
        assert self.bus is not None  # noqa: S101 - made by start()
        tasks = {
            "assignment": task_for(
                self.settings.assignment,
                node=self.core.addr.node,
                debounce_s=self.settings.agent.policy_reload_debounce_s,
                on_update=self.assigned,
                gpus=lambda: gpu_keys(self.core.infos.values()),
                classes=self.core.policy_classes,
            ),
            "broker-silence": silence.watch_task(
                self.settings.agent.control_silence_failover_s,
                self.bus,
                heard_ns=lambda: self.core.intake.last_control_mono_ns,
                mono_ns=self.mono_ns,
                log=self.log,
            ),
        }
        return {name: task for name, task in tasks.items() if task is not None}

    # ------------------------------------------------------------------ policy

    def reload_policy(self, *, trigger: str) -> bool:
        """Reload the policy file; keep the last good policy when the new one is invalid."""
        ignored = self.core.policy_file_ignored(trigger)
        if ignored is not None:
            self._carry_out(ignored)
            return False
        return self.reloader.reload(trigger=trigger)

    def _policy_changed(self) -> None:
        self._carry_out(self.core.policy_reloaded_from_file(now_ns=self.clock_ns()))
        self._wake.set()


__all__ = ["Agent"]
