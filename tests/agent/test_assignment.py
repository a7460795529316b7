"""Every assignment source takes one path into the agent's core: the MQTT message, the
Kubernetes source and the file source end in ``AgentCore.assign``'s checks, and each GPU's
class, where it came from and who holds it show in the status and the telemetry."""

from __future__ import annotations

from pathlib import Path

from polca.agent.messages import Health
from polca.agent.window import TelemetryWindow
from polca.assign.model import AssignmentUpdate, Workload
from polca.telemetry.schema import Assignment, Status, Telemetry, decode, encode
from tests.agent.test_core import ADDR, MONO0, TOPICS, WALL0, Node, S

ASSIGN = TOPICS.node(ADDR, "assign")


def telemetry(node: Node) -> Telemetry:
    window = TelemetryWindow(dict(node.core.infos))
    for sample in node.samples.values():
        window.add(sample)
    health = Health(
        ticks=1, tick_p99_ms=None, gpu_call_p99_ms=None, bus=None, rejected=0, gpu_errors=0
    )
    message, effects = node.core.telemetry(window, health=health, now_ns=WALL0, now_s=1.0)
    node.keep(effects)
    return message


def statuses(node: Node) -> list[Status]:
    return [decode(m.payload, Status) for m in node.on("status")]


def test_a_kubernetes_agent_does_not_read_the_mqtt_assignment(tmp_path: Path) -> None:
    node = Node(tmp_path, assignment_source="kubernetes")
    assert ASSIGN not in {topic for topic, _ in node.core.subscriptions()}
    stray = Assignment(ts_ns=WALL0, classes={"0": "low"})
    assert not node.receive(ASSIGN, encode(stray), mono=MONO0)  # not its source: dropped
    assert node.core.runtime_classes == {}
    (tmp_path / "mqtt").mkdir()
    mqtt = Node(tmp_path / "mqtt")
    assert ASSIGN in {topic for topic, _ in mqtt.core.subscriptions()}


def test_a_sources_update_sets_classes_origins_and_workloads(tmp_path: Path) -> None:
    node = Node(tmp_path, assignment_source="kubernetes", class_dwell_s=0)
    gpu0, gpu1 = node.infos[0].uuid, node.infos[1].uuid
    update = AssignmentUpdate(
        source="kubernetes",
        classes={gpu0: "high", gpu1: "low"},
        origins={gpu0: "annotation", gpu1: "idle"},
        workloads={gpu0: Workload("serving", "llm-0", "server")},
    )
    received = node.core.assign(update, now_mono_ns=MONO0, now_ns=WALL0)
    node.keep(received.effects)
    assert received.wake
    node.step(MONO0 + S)
    message = telemetry(node)
    by_index = {g.index: g for g in message.gpus}
    assert by_index[0].priority_class == "high"
    assert by_index[0].class_origin == "annotation"
    assert by_index[0].workload is not None
    assert (by_index[0].workload.namespace, by_index[0].workload.pod) == ("serving", "llm-0")
    assert by_index[1].class_origin == "idle"
    assert by_index[1].workload is None
    assert by_index[2].class_origin is None  # no runtime class: the policy's map decides


def test_an_unhealthy_source_is_in_the_status_and_the_log_once(tmp_path: Path) -> None:
    node = Node(tmp_path, assignment_source="kubernetes", class_dwell_s=0)
    gpu0 = node.infos[0].uuid
    down = AssignmentUpdate(
        source="kubernetes",
        classes={gpu0: "low"},
        origins={gpu0: "fallback"},
        healthy=False,
        reason="pod-resources unreadable for 31 s",
    )
    node.keep(node.core.assign(down, now_mono_ns=MONO0, now_ns=WALL0).effects)
    node.keep(node.core.assign(down, now_mono_ns=MONO0 + S, now_ns=WALL0 + S).effects)
    status = statuses(node)[-1]
    assert status.assignment_source == "kubernetes"
    assert status.assignment_healthy is False
    assert status.assignment_reason == "pod-resources unreadable for 31 s"
    assert len(node.lines("assignment_source_failed", "warning")) == 1
    up = AssignmentUpdate(source="kubernetes", classes={gpu0: "high"}, origins={gpu0: "priority"})
    node.keep(node.core.assign(up, now_mono_ns=MONO0 + 2 * S, now_ns=WALL0 + 2 * S).effects)
    assert statuses(node)[-1].assignment_healthy is True
    assert len(node.lines("assignment_source_healthy")) == 1


def test_an_update_naming_an_unknown_class_is_refused_whole(tmp_path: Path) -> None:
    node = Node(tmp_path, assignment_source="file", class_dwell_s=0)
    gpu0 = node.infos[0].uuid
    node.keep(
        node.core.assign(
            AssignmentUpdate(source="file", classes={gpu0: "platinum", "1": "low"}),
            now_mono_ns=MONO0,
            now_ns=WALL0,
        ).effects
    )
    assert node.core.runtime_classes == {}
    assert node.lines("message_rejected")  # counted and logged, reason unknown_class


def test_the_mqtt_assignment_takes_the_same_path_and_says_mqtt(tmp_path: Path) -> None:
    node = Node(tmp_path, class_dwell_s=0)
    assignment = Assignment(ts_ns=WALL0, classes={"0": "high", "GPU-none": "low"})
    assert node.receive(ASSIGN, encode(assignment), mono=MONO0)
    assert node.core.runtime_classes == {"0": "high"}  # the stranger dropped
    node.step(MONO0 + S)
    assert {g.index: g.class_origin for g in telemetry(node).gpus}[0] == "mqtt"
