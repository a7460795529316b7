"""AgentCore: what a message makes the agent do elsewhere is bounded, not paced by its sender.

Schema-valid messages from someone holding scheduler or control credentials: flapping
priority assignments (each change may be a cap write), assignments naming GPUs the node
does not have, invalid policy bundles (each one an event), forged leadership terms and
stamps. The core is driven directly, with the times of receipt and of decision passed in,
and what it returns (messages, log lines) collected.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from polca.agent.config import AgentSettings
from polca.agent.core import AgentCore
from polca.agent.intake import REPORT_EVERY_S
from polca.agent.plans import Effects
from polca.gpu.simulated import SimulatedBackend
from polca.policy import PolicyStore
from polca.policy.loader import revision_of
from polca.telemetry.messages import InMessage, OutMessage
from polca.telemetry.schema import Assignment, Control, Event, PolicyBundle, encode
from polca.telemetry.topics import NodeAddress, Topics
from tests.row import policy_file

S = 1_000_000_000
WALL0 = 1_700_000_000 * S
MONO0 = 5_000 * S
ADDR = NodeAddress("dc1", "row1", "rack1", "n1")
TOPICS = Topics()
LOW_T2_MHZ = 1110
HIGH_T2_MHZ = 1305


class Logs:
    """The log lines the core returned, as (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def events(self, event: str, level: str | None = None) -> list[dict[str, Any]]:
        """The fields of every line of ``event`` (at ``level``, when given)."""
        return [f for lv, ev, f in self.lines if ev == event and level in (None, lv)]


class Node:
    """One AgentCore on four simulated GPUs, its published messages and its logs."""

    def __init__(self, tmp_path: Path, **settings: Any) -> None:
        path = policy_file(tmp_path)
        store = PolicyStore(path)
        assert not store.reload().errors
        self.published: list[OutMessage] = []
        self.logs = Logs()
        self.core = AgentCore(
            addr=ADDR,
            topics=TOPICS,
            settings=AgentSettings(
                policy_file=path, state_dir=tmp_path, control_issuers=("agg",), **settings
            ),
            policy_store=store,
        )
        self.infos = SimulatedBackend(count=4, model="A100-SXM4", seed=7).discover()
        self.take(self.core.discovered(self.infos, grace_until_mono_ns=MONO0))
        self.seq = 0

    def take(self, effects: Effects) -> None:
        """Keep what one call into the core returned."""
        self.published.extend(effects.messages)
        self.logs.lines.extend((line.level, line.event, dict(line.fields)) for line in effects.logs)

    def receive(self, topic: str, payload: bytes, *, mono: int) -> None:
        received = self.core.receive(
            InMessage(topic, payload, retain=False, received_ns=WALL0, received_mono_ns=mono)
        )
        self.take(received.effects)

    def control(self, level: int, *, mono: int, term: int = 0, issued_ns: int = WALL0) -> None:
        """A live row control from the row's controller, at ``mono``."""
        self.seq += 1
        control = Control(
            ts_ns=issued_ns,
            scope="row",
            row="row1",
            issuer="agg",
            term=term,
            epoch_ns=WALL0 - 60 * S,
            seq=self.seq,
            level=level,
            issued_ns=issued_ns,
            lease_expires_ns=issued_ns + 10 * S,
        )
        self.receive(TOPICS.row_control("dc1", "row1"), encode(control), mono=mono)

    def assign(self, classes: Mapping[str, str], *, mono: int) -> None:
        message = Assignment(ts_ns=WALL0, classes=dict(classes))
        self.receive(TOPICS.node(ADDR, "assign"), encode(message), mono=mono)

    def decide(self, mono: int) -> None:
        """What the controller does when woken: decide (the writes are not made here)."""
        self.take(self.core.control_step(now_mono_ns=mono, now_ns=WALL0).effects)

    def caps(self) -> dict[int, int | None]:
        return {t.index: t.sm_clock_max_mhz for t in self.core.last_targets}

    def events(self, name: str) -> list[Event]:
        out = []
        for message in self.published:
            if not message.topic.endswith("/events"):
                continue
            event = Event.model_validate_json(message.payload)
            if event.event == name:
                out.append(event)
        return out


# ---------------------------------------------------------------- priority class dwell


def test_flapping_assignments_change_each_gpu_at_most_twice(tmp_path: Path) -> None:
    """200 assignments flipping two GPUs' classes within 1 s, the controller deciding after
    each: each GPU's cap changes at most twice (the first change at once, the last one after
    the dwell), and the last assignment is in force once the dwell has passed."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.decide(MONO0)
    assert node.caps() == {0: HIGH_T2_MHZ, 1: LOW_T2_MHZ, 2: LOW_T2_MHZ, 3: LOW_T2_MHZ}
    changes: Counter[int] = Counter()
    caps = node.caps()
    flips = [{"1": "high", "2": "low"}, {"1": "low", "2": "high"}]
    mono = MONO0
    for i in range(200):
        mono += 5_000_000  # 200 messages in 1 s
        node.assign(flips[i % 2], mono=mono)
        node.decide(mono)
        now = node.caps()
        changes.update(index for index in now if now[index] != caps[index])
        caps = now
    assert changes == Counter({1: 1})  # GPU 1's first change; GPU 2's first was to its class
    assert node.core.classes.deferred >= 198
    deferred_lines = node.logs.events("priority_change_deferred")
    assert len(deferred_lines) == 1  # once per interval, not per message
    while mono < MONO0 + 8 * S:  # the sampling ticks wake the controller (10 Hz)
        mono += S // 10
        if mono % (S // 2) == 0:
            node.control(2, mono=mono)  # the controller renews its lease
        node.decide(mono)
        now = node.caps()
        changes.update(index for index in now if now[index] != caps[index])
        caps = now
    assert changes == Counter({1: 2, 2: 1})
    assert node.caps() == {0: HIGH_T2_MHZ, 1: LOW_T2_MHZ, 2: HIGH_T2_MHZ, 3: LOW_T2_MHZ}
    assert node.core.classes.in_force == {1: "low", 2: "high"}
    assert len(node.logs.events("priority_assigned", "info")) == 2  # two changes applied


def test_a_deferred_change_waits_exactly_the_dwell_and_none_is_lost(tmp_path: Path) -> None:
    """The first change applies at once; the next within the dwell applies when it ends."""
    node = Node(tmp_path, class_dwell_s=5.0)
    node.control(2, mono=MONO0)
    node.assign({"1": "high"}, mono=MONO0)
    node.decide(MONO0)
    assert node.core.classes.of(1) == "high"
    node.assign({}, mono=MONO0 + S)  # cleared: back to the policy's static map
    node.decide(MONO0 + S)
    assert node.core.classes.of(1) == "high"
    node.decide(MONO0 + 5 * S - 1)
    assert node.core.classes.of(1) == "high"
    node.decide(MONO0 + 5 * S)
    assert node.core.classes.of(1) is None
    assert node.caps()[1] == LOW_T2_MHZ
    # A change long after the last one applies at once.
    node.assign({"1": "high"}, mono=MONO0 + 20 * S)
    node.decide(MONO0 + 20 * S)
    assert node.caps()[1] == HIGH_T2_MHZ


def test_a_zero_dwell_applies_every_change_at_once(tmp_path: Path) -> None:
    """class_dwell_s 0 keeps the old behaviour."""
    node = Node(tmp_path, class_dwell_s=0)
    node.control(2, mono=MONO0)
    for i, cls in enumerate(("high", "low", "high")):
        node.assign({"1": cls}, mono=MONO0 + i)
        node.decide(MONO0 + i)
        assert node.core.classes.of(1) == cls
    assert node.core.classes.deferred == 0


def test_assignment_entries_for_gpus_the_node_lacks_are_dropped(tmp_path: Path) -> None:
    """Known entries (by index or UUID) apply; unknown ones are counted once per message."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    uuid1 = node.infos[1].uuid
    node.assign(
        {"0": "low", uuid1: "high", "7": "high", "GPU-not-here": "low", "01": "high"},
        mono=MONO0,
    )
    node.decide(MONO0)
    assert node.core.drops.counts["unknown_gpu"] == 1
    assert node.core.runtime_classes == {"0": "low", uuid1: "high"}
    assert node.core.classes.in_force == {0: "low", 1: "high"}
    assert node.caps() == {0: LOW_T2_MHZ, 1: HIGH_T2_MHZ, 2: LOW_T2_MHZ, 3: LOW_T2_MHZ}
    node.assign({"9": "high"}, mono=MONO0 + 10 * S)  # only strangers: assigns nothing
    assert node.core.drops.counts["unknown_gpu"] == 2
    assert node.core.runtime_classes == {}


def test_an_unknown_class_still_refuses_the_whole_assignment(tmp_path: Path) -> None:
    """A class the policy lacks refuses the message, known GPUs or not."""
    node = Node(tmp_path)
    node.assign({"1": "high", "2": "platinum"}, mono=MONO0)
    node.decide(MONO0)
    assert node.core.drops.counts["unknown_class"] == 1
    assert node.core.classes.in_force == {}


# ---------------------------------------------------------------- invalid policy bundles


def _bundle(text: str) -> bytes:
    revision = revision_of(text.encode("utf-8"))
    return encode(PolicyBundle(ts_ns=WALL0, name="x", revision=revision, text=text))


def test_invalid_policy_bundles_publish_a_bounded_number_of_events(tmp_path: Path) -> None:
    """100 copies of one invalid bundle publish one event; 100 distinct invalid ones within
    the interval publish none more; the next one after it says how many were held back."""
    node = Node(tmp_path)
    topic = TOPICS.policy("dc1", "row1")
    mono = MONO0
    for _ in range(100):
        mono += S // 100
        node.receive(topic, _bundle("name: broken\n"), mono=mono)
    assert len(node.events("policy_rejected")) == 1
    assert len(node.logs.events("policy_rejected", "error")) == 1
    assert len(node.logs.events("policy_rejected_again", "debug")) == 99
    for i in range(100):
        mono += S // 200
        node.receive(topic, _bundle(f"name: broken\n# {i}\n"), mono=mono)
    assert len(node.events("policy_rejected")) == 1
    assert node.core.policy_rejections == 200
    mono = MONO0 + int(REPORT_EVERY_S * S) + S
    node.receive(topic, _bundle("name: broken again\n"), mono=mono)
    events = node.events("policy_rejected")
    assert len(events) == 2
    assert events[1].detail["suppressed"] == 199
    assert events[1].detail["revision"] == revision_of(b"name: broken again\n")
    assert len(node.logs.events("policy_rejected", "error")) == 2
    assert node.core.policy.revision != events[1].detail["revision"]  # the last good one


def test_a_valid_bundle_between_resets_the_repeat_rule(tmp_path: Path) -> None:
    """After a valid bundle is adopted, an invalid one seen before is reported again."""
    node = Node(tmp_path)
    topic = TOPICS.policy("dc1", "row1")
    node.receive(topic, _bundle("name: broken\n"), mono=MONO0)
    good = node.core.policy_store.path.read_text(encoding="utf-8") + "# pushed\n"
    node.receive(topic, _bundle(good), mono=MONO0 + S)
    assert node.core.remote_policy
    assert node.core.policy.revision == revision_of(good.encode("utf-8"))
    node.receive(topic, _bundle("name: broken\n"), mono=MONO0 + 20 * S)
    assert len(node.events("policy_rejected")) == 2


# ---------------------------------------------------------------- control messages


def test_a_forged_term_is_refused_and_counted_while_the_controller_lives(
    tmp_path: Path,
) -> None:
    """A control at term 2**62 is dropped as control_term_jump; level 2 stays in force."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0, term=5)
    node.control(0, mono=MONO0 + S, term=2**62)
    assert node.core.drops.counts["control_term_jump"] == 1
    node.decide(MONO0 + S)
    assert node.core.decision is not None
    assert node.core.decision.level == 2


def test_clock_skew_reports_flip_at_most_once_per_interval(tmp_path: Path) -> None:
    """Controls stamped alternately 60 s off and on time: one detection, then at most one
    flip per interval, however fast they come."""
    node = Node(tmp_path)
    mono = MONO0
    for i in range(100):
        mono += S // 100
        node.control(2, mono=mono, issued_ns=WALL0 - 60 * S if i % 2 == 0 else WALL0)
    assert len(node.events("clock_skew_detected")) == 1
    assert node.events("clock_skew_cleared") == []
    assert node.core.clock_skewed
    mono += int(REPORT_EVERY_S * S)
    node.control(2, mono=mono)
    assert len(node.events("clock_skew_cleared")) == 1
    assert not node.core.clock_skewed


@pytest.mark.parametrize("level", [0, 2])
def test_shadow_control_renewals_log_at_debug(tmp_path: Path, level: int) -> None:
    """Observe-mode control at an unchanged level is routine (no lease to compare with)."""
    node = Node(tmp_path)
    for i in range(5):
        node.seq += 1
        control = Control(
            ts_ns=WALL0,
            scope="row",
            row="row1",
            issuer="agg",
            epoch_ns=WALL0 - 60 * S,
            seq=node.seq,
            level=level,
            issued_ns=WALL0,
            lease_expires_ns=WALL0 + 10 * S,
            observe=True,
        )
        node.receive(TOPICS.row_control("dc1", "row1"), encode(control), mono=MONO0 + i)
    assert len(node.logs.events("control_observed", "info")) == 1
    assert len(node.logs.events("control_observed", "debug")) == 4
