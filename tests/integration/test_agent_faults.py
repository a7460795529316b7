"""An agent that fails leaves GPUs at or under the fail-safe caps, and reports a crash loop.

The agent runs in this process on simulated GPUs and a real Mosquitto. An injected fault
(every GPU read raises an exception polca does not expect, as a binding bug would) ends it
the way a real bug would: a task fails and the supervisor tears down. What it leaves on
the GPUs, what it records, and what the next starts say are checked.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from polca.agent.config import Settings
from polca.agent.runtime import Agent
from polca.exits import EXITS_FILE
from polca.gpu.simulated import SimulatedBackend
from polca.policy import PolicyStore
from polca.telemetry.schema import Status
from tests.integration.rig import ROOT, mqtt_config, mqtt_probe, wait_until
from tests.mqtt_broker import MosquittoProcess

A100_MAX_MHZ = 1410
FAIL_SAFE_LOW_MHZ = 1110  # polca-a100.yaml: fail-safe = T2, every GPU is "low" by default


class _Notifier:
    """Collects what the agent would tell systemd."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def ready(self, status: str | None = None) -> bool:
        self.lines.append(f"READY {status}")
        return True

    def status(self, text: str) -> bool:
        self.lines.append(f"STATUS {text}")
        return True

    def stopping(self) -> bool:
        return True

    def reloading(self) -> bool:
        return True

    def watchdog_interval_s(self) -> float | None:
        return None


def _agent(tmp_path: Path, broker: MosquittoProcess, backend: SimulatedBackend) -> Agent:
    policy = tmp_path / "policy.yaml"
    text = (ROOT / "policies" / "polca-a100.yaml").read_text(encoding="utf-8")
    policy.write_text(text.replace("on_stop: fail_safe", "on_stop: restore"), encoding="utf-8")
    settings = Settings(
        mqtt=mqtt_config(broker),
        topics={"site": "dc1", "row": "row1", "rack": "rack1", "node": "node1"},
        agent={
            "policy_file": policy,
            "state_dir": tmp_path / "state",
            "startup_grace_s": 60,
            "sample_interval_s": 0.05,
        },
    )
    return Agent(
        settings,
        backend=backend,
        policy_store=PolicyStore(policy),
        notifier=_Notifier(),  # type: ignore[arg-type]
    )


def _caps_at_most_fail_safe(backend: SimulatedBackend, count: int) -> bool:
    for index in range(count):
        lock, _ = backend.held(index)
        if lock is None or lock[1] > FAIL_SAFE_LOW_MHZ:
            return False
    return True


async def test_a_failing_agent_leaves_fail_safe_caps_not_the_originals(
    tmp_path: Path, mosquitto: MosquittoProcess
) -> None:
    """Uncapped at nominal, an agent whose sampler fails writes the fail-safe caps as it goes."""
    backend = SimulatedBackend(count=4, model="A100-SXM4")
    agent = _agent(tmp_path, mosquitto, backend)
    async with mqtt_probe(mosquitto) as probe:
        run = asyncio.create_task(agent.run())
        await wait_until(lambda: agent.bus is not None and agent.bus.connected.is_set())
        await probe.control(0)
        await wait_until(
            lambda: (
                agent.core.decision is not None
                and agent.core.decision.level == 0
                and not agent.core.decision.fail_safe
            ),
            what="nominal",
        )
        assert all(backend.held(i)[0] is None for i in range(4))  # uncapped
        with capture_logs() as logs:
            backend.fail_samples(RuntimeError("binding bug"))
            with pytest.raises(BaseExceptionGroup) as failure:
                await asyncio.wait_for(run, timeout=15)
    assert failure.group_contains(RuntimeError, match="binding bug")
    assert _caps_at_most_fail_safe(backend, 4), [backend.held(i) for i in range(4)]
    entry = next(e for e in logs if e["event"] == "gpu_fail_safe_on_failure")
    assert entry["failed"] == 0
    assert (tmp_path / "state" / "baseline.json").exists()  # the next start knows
    exits = json.loads((tmp_path / "state" / EXITS_FILE).read_text(encoding="utf-8"))
    assert exits["running"] is False
    assert "binding bug" in exits["exits"][-1]["failure"]


async def test_the_same_failure_three_times_is_reported_as_a_crash_loop(
    tmp_path: Path, mosquitto: MosquittoProcess
) -> None:
    """Three runs ended by one failure: the fourth start says crash loop in log, STATUS and MQTT."""
    backend = SimulatedBackend(count=2, model="A100-SXM4")
    backend.fail_samples(RuntimeError("binding bug"))
    for _ in range(3):
        failing = _agent(tmp_path, mosquitto, backend)
        with pytest.raises(RuntimeError, match="binding bug"):
            await failing.run()
    backend.fail_samples(None)
    agent = _agent(tmp_path, mosquitto, backend)
    async with mqtt_probe(mosquitto) as probe:
        with capture_logs() as logs:
            run = asyncio.create_task(agent.run())
            await wait_until(
                lambda: any(
                    isinstance(s, Status) and "crash loop" in (s.reason or "")
                    for s in probe.of("status")
                ),
                timeout_s=15,
                what="crash loop in the MQTT status",
            )
            agent.stop_requested.set()
            await asyncio.wait_for(run, timeout=15)
    loop = next(e for e in logs if e["event"] == "crash_loop")
    assert loop["runs"] == 3
    assert "RuntimeError: binding bug" in loop["failure"]
    notifier = agent.notifier
    assert isinstance(notifier, _Notifier)
    assert any("crash loop: RuntimeError: binding bug (3 runs)" in line for line in notifier.lines)
    # A clean stop ends the streak: the next start reports nothing.
    exits = json.loads((tmp_path / "state" / EXITS_FILE).read_text(encoding="utf-8"))
    assert exits == {"running": False, "exits": []}
