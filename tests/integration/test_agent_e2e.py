"""The node agent end to end: a real agent process, the fake NVML library, real Mosquitto."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
from pathlib import Path

import pytest

from polca.telemetry.schema import Assignment, State, Status, Telemetry
from tests.fake_nvml import FakeNvml
from tests.integration.conftest import AgentFactory
from tests.integration.rig import A100_POLICY, mqtt_probe, wait_until
from tests.mqtt_broker import MosquittoProcess

HIGH = (0, 1, 2, 3)
LOW = (4, 5, 6, 7)
A100_MAX_MHZ = 1410


def _policy_with_classes(tmp_path: Path, *, on_stop: str = "restore") -> Path:
    """The shipped A100 policy with GPUs 0-3 statically assigned to the high class.

    ``on_stop`` replaces the shipped ``fail_safe`` (most tests check that a stop restores).
    """
    text = A100_POLICY.read_text(encoding="utf-8").replace(
        "by_index: {}", "by_index: {0: high, 1: high, 2: high, 3: high}", 1
    )
    text = re.sub(r"^on_stop: \w+", f"on_stop: {on_stop}", text, count=1, flags=re.MULTILINE)
    assert "0: high" in text
    assert f"on_stop: {on_stop}" in text
    path = tmp_path / "a100-classes.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _locked_max(node: FakeNvml, gpu: int) -> int:
    value = node.get(gpu)["locked_max_mhz"]
    assert isinstance(value, int)
    return value


def _unlocked(node: FakeNvml) -> bool:
    return all(_locked_max(node, g) == 0 for g in range(8))


async def test_telemetry_carries_fake_nvml_values_in_si_units(
    agent_factory: AgentFactory, a100_node: FakeNvml, mosquitto: MosquittoProcess
) -> None:
    """Telemetry reports the library's mW/mJ/MHz/C values as W/J/MHz/C per GPU, by UUID."""
    a100_node.set(2, power_mw=312_500, gpu_temp_c=71, mem_temp_c=None, sm_clock_mhz=1350)
    agent = agent_factory(startup_grace_s=60)
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await wait_until(
            lambda: len(probe.of("telemetry")) >= 2, timeout_s=20, what="two telemetry messages"
        )
        message = probe.of("telemetry")[-1]
        assert isinstance(message, Telemetry)
        assert len(message.gpus) == 8
        gpu2 = message.gpus[2]
        assert gpu2.uuid == a100_node.get(2)["uuid"]
        assert gpu2.power_w == pytest.approx(312.5)
        assert gpu2.power_mean_w == pytest.approx(312.5)
        assert gpu2.gpu_temp_c == 71
        assert gpu2.mem_temp_c is None  # unsupported on this GPU: null, not an error
        assert gpu2.sm_clock_mhz == 1350
        assert gpu2.power_limit_w == pytest.approx(400.0)
        assert gpu2.samples >= 2
        assert message.gpus[0].mem_temp_c == 62
        statuses = [m for m in probe.of("status") if isinstance(m, Status)]
        assert statuses
        assert statuses[-1].state == "online"
        assert statuses[-1].gpu_count == 8
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


async def test_t2_control_caps_by_class_within_a_tick_and_sigterm_restores(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """T2 locks low priority <= 1110 MHz and high <= 1305 MHz; SIGTERM puts all back."""
    a100_node.set(5, power_limit_mw=350_000)  # an operator's original limit to restore
    agent = agent_factory(policy=_policy_with_classes(tmp_path))
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        await wait_until(lambda: bool(probe.of("status")), what="online status")
        await probe.control(2)
        await agent.wait_log("cap_applied", where=lambda e: e.get("gpu") == 7)
        for gpu in LOW:
            assert 0 < _locked_max(a100_node, gpu) <= 1110
        for gpu in HIGH:
            assert 1110 < _locked_max(a100_node, gpu) <= 1305
        await wait_until(
            lambda: any(isinstance(s, State) and s.level == 2 for s in probe.of("state")),
            what="retained state at level 2",
        )
        # Back to nominal releases every lock.
        await probe.control(0)
        await wait_until(lambda: _unlocked(a100_node), what="locks released at level 0")
        await probe.control(2)
        await wait_until(lambda: _locked_max(a100_node, 4) > 0, what="relock at T2")
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0
    assert _unlocked(a100_node)
    assert a100_node.get(5)["power_limit_mw"] == 350_000
    assert not (agent.state_dir / "baseline.json").exists()
    entry = await agent.wait_log("gpu_settings_restored")
    assert entry["failed"] == 0


async def test_expired_lease_brings_fail_safe_caps(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """When the controller's lease runs out, the policy's fail-safe caps apply."""
    agent = agent_factory(policy=_policy_with_classes(tmp_path))
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        await wait_until(lambda: bool(probe.of("status")), what="online status")
        await probe.control(0, lease_s=1.0)
        await agent.wait_log("control_accepted")
        assert _unlocked(a100_node)
        await agent.wait_log("fail_safe_entered", timeout_s=10)
        await wait_until(lambda: 0 < _locked_max(a100_node, 4) <= 1110, what="fail-safe low cap")
        assert 0 < _locked_max(a100_node, 0) <= 1305
        # A controller speaking again lifts the fail-safe.
        await probe.control(0, lease_s=30)
        await agent.wait_log("fail_safe_left")
        await wait_until(lambda: _unlocked(a100_node), what="fail-safe lifted")
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


async def test_sigkill_leaves_caps_and_the_next_start_applies_fail_safe_first(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """SIGKILL at nominal leaves GPUs uncapped; the next start caps them before MQTT, no grace."""
    a100_node.set(6, power_limit_mw=300_000)
    policy = tmp_path / "powercap.yaml"
    policy.write_text(
        _policy_with_classes(tmp_path)
        .read_text(encoding="utf-8")
        .replace(
            "low: {sm_clock_max_mhz: 1110}     # T2 low",
            "low: {sm_clock_max_mhz: 1110, power_limit_w: 250}",
            1,  # the fail-safe caps power too
        ),
        encoding="utf-8",
    )
    assert policy.read_text(encoding="utf-8").count("power_limit_w: 250") == 1
    agent = agent_factory(policy=policy, startup_grace_s=60)
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        await probe.control(2)
        await wait_until(lambda: _locked_max(a100_node, 6) > 0, what="T2 lock")
        await probe.control(0, seq=probe.seq + 1)
        await wait_until(lambda: _unlocked(a100_node), what="nominal: unlocked")
        baseline = agent.state_dir / "baseline.json"
        assert baseline.exists()
        agent.kill()  # killed while uncapped: nothing runs at exit
        assert _unlocked(a100_node)
        await probe.clear_retained("polca/v1/dc1/row1/control")
    again = agent_factory(policy=policy, startup_grace_s=60)
    again.start()
    entry = await again.wait_log("fail_safe_applied_at_start")
    assert entry["failed"] == 0

    def second_run() -> list[str]:
        events = [e["event"] for e in again.logs()]
        return events[len(events) - 1 - events[::-1].index("nvml_opened") :]

    await wait_until(lambda: "mqtt_connected" in second_run(), what="second run connected")
    run = second_run()
    assert run.index("fail_safe_applied_at_start") < run.index("mqtt_connected")
    for gpu in LOW:
        assert 0 < _locked_max(a100_node, gpu) <= 1110
    for gpu in HIGH:
        assert 0 < _locked_max(a100_node, gpu) <= 1305
    assert a100_node.get(6)["power_limit_mw"] == 250_000
    await asyncio.sleep(2)  # no start-up grace after a crash: still capped, no controller
    assert 0 < _locked_max(a100_node, 4) <= 1110
    assert not any(e.get("event") == "fail_safe_left" for e in again.logs())
    # The original limit stays the baseline: a clean restoring stop puts it back.
    again.signal(signal.SIGTERM)
    assert again.wait() == 0
    assert _unlocked(a100_node)
    assert a100_node.get(6)["power_limit_mw"] == 300_000
    assert not baseline.exists()


async def test_sigkill_during_a_write_then_restart_caps_every_gpu_first(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """Killed halfway through writing T2 (slow driver), the next start fail-safes all 8 GPUs."""
    policy = _policy_with_classes(tmp_path)
    agent = agent_factory(policy=policy, startup_grace_s=60)
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        await probe.control(0)
        await agent.wait_log("control_accepted")
        a100_node.set(write_delay_ms=150)  # 8 locks take 1.2 s
        await probe.control(2)
        await wait_until(
            lambda: 0 < sum(1 for g in range(8) if _locked_max(a100_node, g) > 0) < 8,
            timeout_s=10,
            what="some but not all GPUs locked",
        )
        agent.kill()
        locked = [g for g in range(8) if _locked_max(a100_node, g) > 0]
        assert 0 < len(locked) < 8  # the kill interrupted the write
        a100_node.set(write_delay_ms=0)
        await probe.clear_retained("polca/v1/dc1/row1/control")
    again = agent_factory(policy=policy, startup_grace_s=60)
    again.start()
    await wait_until(
        lambda: any(e["event"] == "fail_safe_applied_at_start" for e in again.logs()),
        what="fail-safe at start",
    )
    for gpu in LOW:
        assert 0 < _locked_max(a100_node, gpu) <= 1110
    for gpu in HIGH:
        assert 0 < _locked_max(a100_node, gpu) <= 1305
    again.signal(signal.SIGTERM)
    assert again.wait() == 0


async def test_shipped_policy_stop_leaves_fail_safe_caps(
    agent_factory: AgentFactory, a100_node: FakeNvml, mosquitto: MosquittoProcess
) -> None:
    """With the shipped on_stop: fail_safe, SIGTERM at nominal leaves the fail-safe caps."""
    agent = agent_factory(startup_grace_s=60)  # the shipped polca-a100.yaml
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        await probe.control(0)
        await agent.wait_log("control_accepted")
        assert _unlocked(a100_node)
        agent.signal(signal.SIGTERM)
        assert agent.wait() == 0
    await agent.wait_log("gpu_fail_safe_on_stop")
    assert all(0 < _locked_max(a100_node, g) <= 1110 for g in range(8))  # all default: low
    assert (agent.state_dir / "baseline.json").exists()


async def test_broker_restart_reconnects_republishes_and_keeps_enforcing(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """A broker outage shorter than the lease keeps the caps; the agent comes back online."""
    agent = agent_factory(policy=_policy_with_classes(tmp_path))
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        await probe.control(2, lease_s=60)
        await wait_until(lambda: _locked_max(a100_node, 4) > 0, what="T2 lock")
    mosquitto.kill()
    await agent.wait_log("mqtt_disconnected")
    mosquitto.start()  # same port; persistence off, so retained messages are gone
    async with mqtt_probe(mosquitto) as probe:
        await wait_until(
            lambda: any(isinstance(s, Status) and s.state == "online" for s in probe.of("status")),
            timeout_s=15,
            what="status republished after reconnect",
        )
        await wait_until(lambda: bool(probe.of("telemetry")), what="telemetry after reconnect")
        assert 0 < _locked_max(a100_node, 4) <= 1110  # still enforcing within the lease
        assert not any(e.get("event") == "fail_safe_entered" for e in agent.logs())
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


async def test_one_lost_gpu_does_not_stop_the_others(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """GPU_IS_LOST on one GPU marks it lost; the other seven are sampled and capped."""
    agent = agent_factory(policy=_policy_with_classes(tmp_path))
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        a100_node.lose(5)
        entry = await agent.wait_log("gpu_lost")
        assert entry["gpu"] == 5
        await probe.control(2)
        await agent.wait_log("cap_applied", where=lambda e: e.get("gpu") == 7)
        assert _locked_max(a100_node, 4) > 0
        assert _locked_max(a100_node, 6) > 0

        def lost_in_telemetry() -> bool:
            last = probe.of("telemetry")[-1:]
            return bool(last) and isinstance(last[0], Telemetry) and last[0].gpus[5].state == "lost"

        await wait_until(lost_in_telemetry, what="GPU 5 reported lost")
        events = [e for e in probe.of("events") if getattr(e, "event", "") == "gpu_lost"]
        assert events
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


async def test_no_privilege_is_a_clear_fatal_error(
    agent_factory: AgentFactory, a100_node: FakeNvml
) -> None:
    """Without root the agent exits 78 with a message naming CAP_SYS_ADMIN and observe-only."""
    a100_node.set(privileged=False)
    agent = agent_factory()
    agent.start()
    assert agent.wait() == 78
    entry = await agent.wait_log("agent_fatal")
    assert "CAP_SYS_ADMIN" in entry["error"]
    assert "observe" in entry["error"].lower()


async def test_observe_only_runs_without_privilege_and_never_writes(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """Observe-only mode publishes decisions but leaves the GPUs untouched."""
    a100_node.set(privileged=False)
    agent = agent_factory(policy=_policy_with_classes(tmp_path), observe_only=True)
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await probe.control(2)
        await wait_until(
            lambda: any(isinstance(s, State) and s.level == 2 for s in probe.of("state")),
            what="state at level 2",
        )
        state = next(s for s in reversed(probe.of("state")) if isinstance(s, State))
        assert state.observe_only
        assert not any(g.applied for g in state.gpus)
        assert _unlocked(a100_node)
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


async def test_invalid_policy_edit_keeps_last_good_and_valid_edit_applies(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """A broken edit is rejected with FILE:LINE:COL problems; a valid one applies in seconds."""
    agent = agent_factory(policy=_policy_with_classes(tmp_path))
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        first = await agent.wait_log("policy_loaded")
        await probe.control(1)
        await wait_until(lambda: 0 < _locked_max(a100_node, 4) <= 1275, what="T1 lock")
        good = agent.policy_path.read_text(encoding="utf-8")
        agent.policy_path.write_text(
            good.replace("threshold_pct: 80", "threshold_pct: 95"), encoding="utf-8"
        )
        rejected = await agent.wait_log("policy_rejected")
        assert any(str(agent.policy_path) in p for p in rejected["problems"])
        assert rejected["revision_in_force"] == first["revision"]
        assert 0 < _locked_max(a100_node, 4) <= 1275  # the last good policy still holds
        agent.policy_path.write_text(
            good.replace("low: {sm_clock_max_mhz: 1275}", "low: {sm_clock_max_mhz: 1200}"),
            encoding="utf-8",
        )
        reloaded = await agent.wait_log("policy_reloaded")
        assert reloaded["revision"] != first["revision"]
        await wait_until(lambda: 0 < _locked_max(a100_node, 4) <= 1200, what="new T1 cap")
        # SIGHUP (systemctl reload) re-reads the file too.
        agent.signal(signal.SIGHUP)
        await agent.wait_log("policy_unchanged", where=lambda e: e.get("trigger") == "sighup")
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


async def test_runtime_priority_assignment_and_bad_messages(
    tmp_path: Path,
    agent_factory: AgentFactory,
    a100_node: FakeNvml,
    mosquitto: MosquittoProcess,
) -> None:
    """A scheduler's assignment moves a GPU to high priority; junk and stale control are dropped."""
    agent = agent_factory(policy=_policy_with_classes(tmp_path))
    async with mqtt_probe(mosquitto) as probe:
        agent.start()
        await agent.wait_log("policy_loaded")
        await probe.control(2, seq=10)
        await wait_until(lambda: 0 < _locked_max(a100_node, 4) <= 1110, what="T2 low cap")
        node_topic = "polca/v1/dc1/row1/rack1/node1"
        await probe.publish_raw(
            f"{node_topic}/assign",
            Assignment(ts_ns=1, classes={str(a100_node.get(4)["uuid"]): "high"})
            .model_dump_json()
            .encode(),
            retain=True,
        )
        await wait_until(lambda: _locked_max(a100_node, 4) > 1110, what="GPU 4 raised to high")
        assert _locked_max(a100_node, 4) <= 1305
        # Malformed, wrong-version and stale control never change anything.
        await probe.publish_raw("polca/v1/dc1/row1/control", b"{not json")
        await probe.publish_raw("polca/v1/dc1/row1/control", b'{"schema_version": 9}')
        await probe.control(0, seq=3)  # older than seq 10: ignored
        await agent.wait_log("control_ignored", where=lambda e: e.get("verdict") == "stale")
        rejected = {e["reason"] for e in agent.logs() if e.get("event") == "message_rejected"}
        assert {"malformed", "schema_version", "control_stale"} <= rejected
        assert 0 < _locked_max(a100_node, 5) <= 1110
        # An assignment naming a class the policy lacks is refused as a whole.
        await probe.publish_raw(
            f"{node_topic}/assign",
            Assignment(ts_ns=2, classes={"5": "platinum"}).model_dump_json().encode(),
        )
        await agent.wait_log("message_rejected", where=lambda e: "platinum" in e.get("detail", ""))
        assert _locked_max(a100_node, 5) <= 1110
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0


async def test_systemd_notify_ready_watchdog_and_stopping(
    tmp_path: Path, agent_factory: AgentFactory, mosquitto: MosquittoProcess
) -> None:
    """READY=1 after start-up, WATCHDOG=1 while the loop runs, STOPPING=1 at SIGTERM."""
    sock_path = tmp_path / "notify.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(sock_path))
    server.setblocking(False)
    agent = agent_factory()
    agent.extra_env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"}
    received: list[str] = []

    def drain() -> list[str]:
        while True:
            try:
                received.append(server.recv(4096).decode())
            except BlockingIOError:
                return received

    try:
        agent.start()
        await wait_until(lambda: any("READY=1" in d for d in drain()), timeout_s=15, what="READY=1")
        await wait_until(
            lambda: any("WATCHDOG=1" in d for d in drain()), timeout_s=5, what="WATCHDOG=1"
        )
        assert any("STATUS=" in d and "8 GPUs" in d for d in received)
        agent.signal(signal.SIGTERM)
        assert agent.wait() == 0
        assert any("STOPPING=1" in d for d in drain())
    finally:
        server.close()
