"""``polca demo``: the whole control loop on one machine, with nothing to install.

One process runs an embedded MQTT broker (or uses ``--broker``), a node agent on simulated
GPUs, and a minimal row controller: it treats the node as a one-node row with a budget
below what the simulated inference load draws, runs the POLCA ladder from the shared
policy engine on the node's telemetry and publishes leased control messages. Everything
the agent publishes and applies is printed as it happens; a summary ends the run.

The real row controller is the aggregator; this one exists so a new user can watch
T1 and T2 caps being decided, applied and released within a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import structlog

from polca import aiokit
from polca.agent.runtime import Agent
from polca.aiokit import guard
from polca.gpu.simulated import SimulatedBackend
from polca.policy import LadderState, PolicyStore, next_level
from polca.settings import Settings
from polca.telemetry.bus import InMessage, MqttBus, OutMessage
from polca.telemetry.schema import Control, Event, SchemaError, State, Telemetry, decode, encode
from polca.telemetry.topics import Topics

DEMO_POLICY = Path(__file__).resolve().parents[2] / "policies" / "simulated-demo.yaml"
LEASE_S = 5.0


@dataclass(slots=True)
class _Summary:
    level_s: Counter[int] = field(default_factory=Counter)
    peak_pct: float = 0.0
    messages: Counter[str] = field(default_factory=Counter)
    cap_events: int = 0


class DemoController:
    """A one-node row controller and console printer for the demo."""

    def __init__(self, settings: Settings, *, budget_w: float, out: TextIO) -> None:
        self.settings = settings
        self.budget_w = budget_w
        self.out = out
        self.topics = Topics(settings.topics.root)
        self.ladder = LadderState()
        self.seq = 0
        self.epoch_ns = time.time_ns()
        self.summary = _Summary()
        self.policy_store = PolicyStore(settings.agent.policy_file)
        self.policy_store.reload()
        t = settings.topics
        self.bus = MqttBus(
            settings.mqtt,
            client_id=f"polca-demo-controller-{t.node}",
            subscriptions=[(f"{t.root}/{t.site}/#", 1)],
        )

    async def run(self) -> None:
        """Consume every message of the site; control the row on each telemetry message."""
        while True:
            message = await self.bus.get()
            self.handle(message)

    def handle(self, message: InMessage) -> None:
        """Print one message and, for telemetry, decide and publish the row's level."""
        channel = message.topic.rsplit("/", 1)[-1]
        try:
            payload = decode(message.payload)
        except SchemaError as exc:
            self._print(f"!! {message.topic}: rejected ({exc})")
            return
        self.summary.messages[channel] += 1
        if isinstance(payload, Telemetry):
            self._on_telemetry(payload)
        elif isinstance(payload, Control):
            name = payload.level_name or str(payload.level)
            self._print(
                f"-> control  level {payload.level} ({name})  seq {payload.seq}  "
                f"lease {LEASE_S:.0f}s  {payload.reason}"
            )
        elif isinstance(payload, State):
            caps = ", ".join(
                f"gpu{g.index}[{g.priority_class}] "
                + (f"<= {g.sm_clock_max_mhz} MHz" if g.sm_clock_max_mhz else "uncapped")
                for g in payload.gpus
            )
            mode = "FAIL-SAFE" if payload.fail_safe else f"level {payload.level}"
            self._print(f"<- state    {mode}: {caps}")
        elif isinstance(payload, Event):
            if payload.event in ("cap_changed", "cap_reasserted"):
                self.summary.cap_events += len(payload.detail.get("gpus", ()))
            else:
                self._print(f"<- event    {payload.event} gpu={payload.gpu} {payload.detail}")

    def _on_telemetry(self, msg: Telemetry) -> None:
        policy = self.policy_store.current
        if policy is None:
            return
        levels = policy.policy.levels
        power_w = msg.node_gpu_power_w
        pct = 100.0 * power_w / self.budget_w
        self.summary.peak_pct = max(self.summary.peak_pct, pct)
        self.summary.level_s[msg.level] += 1
        hot = max(
            (g for g in msg.gpus if g.gpu_temp_c is not None),
            key=lambda g: g.gpu_temp_c or 0.0,
            default=None,
        )
        clocks = " ".join(f"{g.sm_clock_mhz or 0:>4}" for g in msg.gpus)
        marks = " ".join(f"{lvl.name}={lvl.threshold_pct:.0f}%" for lvl in levels)
        self._print(
            f"<- telemetry {msg.node}: {power_w:7.0f} W = {pct:5.1f}% of {self.budget_w:.0f} W "
            f"({marks})  level {msg.level}  SM MHz [{clocks}]"
            + (f"  hottest gpu{hot.index} {hot.gpu_temp_c:.0f} C" if hot else "")
        )
        now_s = time.monotonic()
        new = next_level(
            power_w=power_w,
            budget_w=self.budget_w,
            policy=policy.policy,
            state=self.ladder,
            now_s=now_s,
        )
        self.ladder = new
        self.seq += 1
        now_ns = time.time_ns()
        name = levels[new.level - 1].name if new.level else "nominal"
        t = self.settings.topics
        control = Control(
            ts_ns=now_ns,
            scope="row",
            row=t.row,
            issuer="demo",
            epoch_ns=self.epoch_ns,
            seq=self.seq,
            level=new.level,
            level_name=name,
            issued_ns=now_ns,
            lease_expires_ns=now_ns + int(LEASE_S * 1e9),
            policy_revision=policy.revision,
            reason=f"row power {pct:.1f}% of budget",
        )
        self.bus.publish_nowait(
            OutMessage(self.topics.row_control(t.site, t.row), encode(control), qos=1, retain=True)
        )

    def _print(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def print_summary(self) -> None:
        """Time at each level, capping events and the peak, as a closing table."""
        total = sum(self.summary.level_s.values()) or 1
        self._print("\n== polca demo summary ==")
        for level, count in sorted(self.summary.level_s.items()):
            self._print(f"level {level}: {count:4d} s ({100.0 * count / total:5.1f}%)")
        self._print(
            f"peak node power: {self.summary.peak_pct:.1f}% of the {self.budget_w:.0f} W budget"
        )
        self._print(f"cap changes applied: {self.summary.cap_events}")
        self._print(f"messages seen: {dict(self.summary.messages)}")


async def run_demo(
    settings: Settings,
    *,
    duration_s: float | None,
    budget_w: float | None,
    out: TextIO = sys.stdout,
) -> None:
    """Run broker, agent and demo controller until ``duration_s`` passes or a signal."""
    agent_overrides: dict[str, object] = {
        "startup_grace_s": min(settings.agent.startup_grace_s, 10.0)
    }
    if "policy_file" not in settings.agent.model_fields_set:
        agent_overrides["policy_file"] = DEMO_POLICY
    async with contextlib.AsyncExitStack() as stack:
        state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polca-demo-")))
        if "state_dir" not in settings.agent.model_fields_set:
            agent_overrides["state_dir"] = state_dir
        settings = settings.model_copy(
            update={"agent": settings.agent.model_copy(update=agent_overrides)}
        )
        if (
            settings.mqtt.host in ("127.0.0.1", "localhost")
            and "port" not in settings.mqtt.model_fields_set
        ):
            from polca.telemetry.broker import EmbeddedBroker  # noqa: PLC0415

            broker = await stack.enter_async_context(EmbeddedBroker(host="127.0.0.1", port=0))
            settings = settings.model_copy(
                update={"mqtt": settings.mqtt.model_copy(update={"port": broker.port})}
            )
            out.write(f"embedded MQTT broker on 127.0.0.1:{broker.port}\n")
        backend = SimulatedBackend(
            count=settings.gpu.simulated_count,
            model=settings.gpu.simulated_model,
            load=settings.gpu.simulated_load,
            seed=settings.gpu.simulated_seed,
        )
        agent = Agent(
            settings, backend=backend, policy_store=PolicyStore(settings.agent.policy_file)
        )
        if budget_w is None:
            infos = backend.discover()
            budget_w = 0.85 * sum((i.power_limit_default_mw or 0) for i in infos) / 1000.0
        controller = DemoController(settings, budget_w=budget_w, out=out)
        aiokit.install_signal_handlers(agent.stop_requested, agent.reload_requested)
        if duration_s is not None:
            asyncio.get_running_loop().call_later(duration_s, agent.stop_requested.set)
        structlog.get_logger().info(
            "demo_started", budget_w=budget_w, policy=str(settings.agent.policy_file)
        )
        async with asyncio.TaskGroup() as tg:
            bus_task = tg.create_task(controller.bus.run())
            ctl_task = tg.create_task(guard("demo_controller", controller.run()))
            try:
                await agent.run()
            finally:
                await asyncio.sleep(0.3)  # let the final messages arrive
                ctl_task.cancel()
                bus_task.cancel()
        controller.print_summary()
