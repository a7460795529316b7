"""AgentCore driven directly: time in, effects out.

The core gets the times (monotonic, loop seconds, wall), readings, messages and write
results, and returns plans: GPU writes, numbered and stamped messages, log lines. Here the
test is the shell: it executes the planned writes on a ``SimulatedBackend`` (the same
``execute_writes`` the GPU thread runs) or hands back results it made up, and reads what
the core returned. No event loop, bus, thread or clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grimp
import pytest

from polca.agent.actuator import GpuPlan
from polca.agent.baseline import Baseline
from polca.agent.config import AgentSettings
from polca.agent.core import AgentCore
from polca.agent.fleet import LOST_RETRY_S
from polca.agent.messages import Health, Identity
from polca.agent.plans import Effects, StepPlan
from polca.agent.window import TelemetryWindow
from polca.errors import GpuError, GpuLostError
from polca.gpu.backend import (
    GpuSample,
    LockSmClocks,
    ResetSmClocks,
    SetPowerLimit,
    WriteResult,
    execute_writes,
)
from polca.gpu.clocks import snap_sm_clock_mhz
from polca.gpu.simulated import SimulatedBackend
from polca.policy import PolicyStore
from polca.policy.loader import revision_of
from polca.telemetry.messages import InMessage, OutMessage
from polca.telemetry.schema import (
    Control,
    Event,
    PolicyBundle,
    State,
    Status,
    Telemetry,
    decode,
    encode,
)
from polca.telemetry.topics import NodeAddress, NodeChannel, Topics
from tests.row import policy_file

S = 1_000_000_000
WALL0 = 1_700_000_000 * S
MONO0 = 5_000 * S
LOOP0_S = 200.0
ADDR = NodeAddress("dc1", "row1", "rack1", "n1")
TOPICS = Topics()
HIGH_T2_MHZ = 1305  # the test policy: GPU 0 is high priority, the others low
LOW_T2_MHZ = 1110
LOW_T1_MHZ = 1275


def wall(mono: int) -> int:
    """The wall clock that goes with monotonic ``mono`` (both move together here)."""
    return WALL0 + (mono - MONO0)


class Node:
    """One AgentCore on four simulated GPUs, with the test as its shell."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        on_stop: str = "restore",
        grace_s: float = 0.0,
        assignment_source: Any = "mqtt",
        **settings: Any,
    ) -> None:
        path = policy_file(tmp_path, on_stop=on_stop)
        store = PolicyStore(path)
        assert not store.reload().errors
        self.core = AgentCore(
            addr=ADDR,
            topics=TOPICS,
            settings=AgentSettings(
                policy_file=path, state_dir=tmp_path, control_issuers=("agg",), **settings
            ),
            policy_store=store,
            identity=Identity("simulated", observe_only=False, started_ns=WALL0),
            assignment_source=assignment_source,
        )
        self.backend = SimulatedBackend(count=4, model="A100-SXM4", seed=7, clock=lambda: 0.0)
        self.infos = self.backend.discover()
        self.published: list[OutMessage] = []
        self.logs: list[tuple[str, str, dict[str, Any]]] = []
        self.status_lines: list[str] = []
        self.keep(self.core.discovered(self.infos, grace_until_mono_ns=MONO0 + int(grace_s * S)))
        self.control_seq = 0
        self.samples = self.read(now_s=LOOP0_S)
        self.core.adopt(list(self.samples.values()))

    # -- the shell's part -----------------------------------------------------------------

    def keep(self, effects: Effects) -> Effects:
        """Take what one call returned, as the shell would emit it."""
        self.published.extend(effects.messages)
        self.logs.extend((line.level, line.event, dict(line.fields)) for line in effects.logs)
        if effects.status_line is not None:
            self.status_lines.append(effects.status_line)
        return effects

    def read(self, *, now_s: float, mono: int = MONO0) -> dict[int, GpuSample]:
        """One round of readings of the GPUs the core asks for."""
        indices = self.core.sample_indices(now_s)
        results: list[GpuSample | GpuError] = []
        for index in indices:
            try:
                results.append(self.backend.sample(index))
            except GpuError as exc:
                results.append(exc)
        sampled = self.core.note_samples(indices, results, now_s=now_s, now_ns=wall(mono))
        self.keep(sampled.effects)
        return dict(sampled.samples)

    def write(self, plans: Sequence[GpuPlan]) -> list[list[WriteResult]]:
        """Execute the planned writes on the simulated GPUs (what the GPU thread runs)."""
        return execute_writes(self.backend, [plan.writes for plan in plans])

    def plan(self, mono: int) -> StepPlan:
        """The core's step at ``mono``, its immediate effects kept."""
        plan = self.core.control_step(now_mono_ns=mono, now_ns=wall(mono))
        self.keep(plan.effects)
        return plan

    def step(self, mono: int, *, now_s: float = LOOP0_S) -> StepPlan:
        """One whole control step: plan, write, feed the results back."""
        plan = self.plan(mono)
        if plan.writes:
            applied = self.core.note_step(
                plan, self.write(plan.writes), now_s=now_s, now_ns=wall(mono), now_mono_ns=mono
            )
            self.keep(applied.effects)
        return plan

    def receive(self, topic: str, payload: bytes, *, mono: int, retain: bool = False) -> bool:
        """Hand one message to the core; whether it wakes the controller."""
        received = self.core.receive(
            InMessage(topic, payload, retain=retain, received_ns=wall(mono), received_mono_ns=mono)
        )
        self.keep(received.effects)
        return received.wake

    def control(self, level: int, *, mono: int, issued_ns: int | None = None) -> bool:
        """A live row control from the row's controller at ``mono``, 10 s lease."""
        self.control_seq += 1
        issued = wall(mono) if issued_ns is None else issued_ns
        control = Control(
            ts_ns=issued,
            scope="row",
            row="row1",
            issuer="agg",
            epoch_ns=WALL0 - 60 * S,
            seq=self.control_seq,
            level=level,
            issued_ns=issued,
            lease_expires_ns=issued + 10 * S,
        )
        return self.receive(TOPICS.row_control("dc1", "row1"), encode(control), mono=mono)

    # -- reading what came out ------------------------------------------------------------

    def on(self, channel: NodeChannel) -> list[OutMessage]:
        """Every message published on one node channel, in order."""
        return [m for m in self.published if m.topic == TOPICS.node(ADDR, channel)]

    def events(self, name: str | None = None) -> list[Event]:
        """The events published (of ``name``, when given), in order."""
        events = [decode(m.payload, Event) for m in self.on("events")]
        return [e for e in events if name is None or e.event == name]

    def states(self) -> list[State]:
        """The retained states published, in order."""
        return [decode(m.payload, State) for m in self.on("state")]

    def lines(self, event: str, level: str | None = None) -> list[dict[str, Any]]:
        """The fields of every log line of ``event`` (at ``level``, when given)."""
        return [f for lv, ev, f in self.logs if ev == event and level in (None, lv)]

    def seqs(self) -> list[int]:
        """The ``seq`` of every numbered message published, in order."""
        out = []
        for message in self.published:
            decoded = decode(message.payload)
            if not isinstance(decoded, Status):
                out.append(decoded.seq)  # type: ignore[union-attr]
        return out


def detail(event: Event) -> Any:
    """An event's detail, as plain JSON values."""
    return dict(event.detail)


def locks(plan: StepPlan | Sequence[GpuPlan]) -> dict[int, int]:
    """The SM clock ceiling each planned lock writes, by GPU."""
    plans = plan.writes if isinstance(plan, StepPlan) else plan
    return {w.index: w.max_mhz for p in plans for w in p.writes if isinstance(w, LockSmClocks)}


def snapped(node: Node, mhz: int) -> int:
    """``mhz`` as the GPUs can lock it."""
    return snap_sm_clock_mhz(mhz, node.infos[0].supported_sm_clocks_mhz)


def t2_locks(node: Node) -> dict[int, int]:
    """What level 2 (and the fail-safe) locks on each GPU."""
    return {0: snapped(node, HIGH_T2_MHZ), **{i: snapped(node, LOW_T2_MHZ) for i in (1, 2, 3)}}


# ---------------------------------------------------------------- decisions -> writes


def test_a_control_level_becomes_one_clock_lock_per_gpu(tmp_path: Path) -> None:
    """Level 2 from the row's controller: each GPU's class cap, snapped to a supported
    clock, as one lock write; the limits polca found stay (no power write), and nothing
    is published before the writes are done."""
    node = Node(tmp_path)
    assert node.control(2, mono=MONO0)
    plan = node.plan(MONO0)
    assert plan.decision is not None
    assert (plan.decision.level, plan.decision.fail_safe) == (2, False)
    assert plan.targets_changed
    assert locks(plan) == t2_locks(node)
    assert all(len(p.writes) == 1 for p in plan.writes)
    assert not any(isinstance(w, SetPowerLimit) for p in plan.writes for w in p.writes)
    assert node.states() == []
    assert plan.effects.status_line is None


def test_write_results_fed_back_publish_one_cap_event_then_the_state(tmp_path: Path) -> None:
    """After the writes: one ``cap_changed`` event naming every GPU, then the retained
    state with every cap applied, stamped with the time passed in; the status line."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.published.clear()
    plan = node.plan(MONO0 + S)
    applied = node.core.note_step(
        plan, node.write(plan.writes), now_s=LOOP0_S, now_ns=wall(MONO0 + S), now_mono_ns=MONO0 + S
    )
    node.keep(applied.effects)
    assert [o.action for o in applied.result.outcomes] == ["applied"] * 4
    assert [m.topic.rsplit("/", 1)[1] for m in applied.effects.messages] == ["events", "state"]
    (event,) = node.events()
    assert event.event == "cap_changed"
    assert [g["gpu"] for g in detail(event)["gpus"]] == [0, 1, 2, 3]
    assert event.ts_ns == wall(MONO0 + S)
    (state,) = node.states()
    assert state.ts_ns == wall(MONO0 + S)
    assert state.level == 2
    assert [(g.sm_clock_max_mhz, g.applied) for g in state.gpus] == [
        (HIGH_T2_MHZ, True),
        (LOW_T2_MHZ, True),
        (LOW_T2_MHZ, True),
        (LOW_T2_MHZ, True),
    ]
    # The lease as this node's wall clock sees it: received at MONO0 with 10 s to run.
    assert state.lease_expires_ns == wall(MONO0) + 10 * S
    assert applied.effects.status_line == node.core.status_line()
    assert "level 2" in applied.effects.status_line
    assert [node.backend.held(i)[0][1] for i in range(4)] == list(t2_locks(node).values())  # type: ignore[index]
    assert len(node.lines("cap_applied", "info")) == 4


def test_nothing_changed_plans_nothing_and_publishes_nothing(tmp_path: Path) -> None:
    """A step with the same inputs as the last one: no decision, no write, no message."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.step(MONO0)
    before = list(node.published)
    plan = node.step(MONO0 + S // 10)
    assert (plan.decision, plan.writes, plan.effects) == (None, (), Effects())
    assert node.published == before


def test_a_new_level_writes_only_the_gpus_whose_cap_changed(tmp_path: Path) -> None:
    """From level 2 to level 1: the low GPUs are relocked higher, the high one unlocked."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.step(MONO0)
    node.control(1, mono=MONO0 + S)
    plan = node.step(MONO0 + S)
    assert locks(plan) == {i: snapped(node, LOW_T1_MHZ) for i in (1, 2, 3)}
    assert list(plan.writes[0].writes) == [ResetSmClocks(0)]
    assert node.lines("level_changed", "info") == [{"old": 2, "new": 1}]
    assert node.states()[-1].level == 1


def test_observe_only_decides_and_publishes_but_writes_nothing(tmp_path: Path) -> None:
    """Observe-only: the decision is taken and its state published at once (applied
    false), and no write is planned."""
    node = Node(tmp_path, observe_only=True)
    node.control(2, mono=MONO0)
    plan = node.plan(MONO0)
    assert plan.decision is not None
    assert plan.decision.level == 2
    assert plan.writes == ()
    (state,) = node.states()
    assert state.observe_only
    assert not any(g.applied for g in state.gpus)
    assert plan.effects.status_line is not None


# ---------------------------------------------------------------- outcomes fed back


def test_a_failed_write_is_reported_once_and_the_gpu_marked_unapplied(tmp_path: Path) -> None:
    """GPU 1's lock fails: a ``cap_failed`` event and the state's ``applied: false`` with
    the error; the same failure again on the next decision is not reported again."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    error = GpuError("insufficient permissions", index=1)

    def fail_gpu_1(plan: StepPlan) -> list[list[WriteResult]]:
        results = node.write(plan.writes)
        results[1] = [WriteResult(plan.writes[1].writes[0], error)]
        return results

    plan = node.plan(MONO0)
    applied = node.core.note_step(
        plan, fail_gpu_1(plan), now_s=LOOP0_S, now_ns=wall(MONO0), now_mono_ns=MONO0
    )
    node.keep(applied.effects)
    assert [o.action for o in applied.result.outcomes] == [
        "applied",
        "failed",
        "applied",
        "applied",
    ]
    (failed,) = node.events("cap_failed")
    assert (failed.gpu, failed.uuid) == (1, node.infos[1].uuid)
    gpus = node.states()[-1].gpus
    assert [g.applied for g in gpus] == [True, False, True, True]
    assert gpus[1].error == "insufficient permissions"
    node.control(1, mono=MONO0 + S)
    plan = node.plan(MONO0 + S)
    assert 1 in locks(plan)  # tried again with the new decision
    node.keep(
        node.core.note_step(
            plan, fail_gpu_1(plan), now_s=LOOP0_S, now_ns=wall(MONO0 + S), now_mono_ns=MONO0 + S
        ).effects
    )
    assert len(node.events("cap_failed")) == 1
    assert len(node.lines("cap_failed", "error")) == 1


def test_a_gpu_lost_while_writing_is_left_out_until_its_retry(tmp_path: Path) -> None:
    """A write that finds GPU 2 gone: ``gpu_lost`` once, GPU 2 out of the next decisions
    and readings, read again ``LOST_RETRY_S`` later by the loop time passed in, and
    ``gpu_recovered`` when it answers."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.backend.lose_gpu(2)
    plan = node.step(MONO0, now_s=LOOP0_S)
    assert 2 in locks(plan)
    (lost,) = node.events("gpu_lost")
    assert lost.gpu == 2
    assert set(node.core.lost) == {2}
    assert node.core.sample_indices(LOOP0_S + LOST_RETRY_S - 0.1) == [0, 1, 3]
    node.control(1, mono=MONO0 + S)
    assert 2 not in locks(node.step(MONO0 + S))
    assert node.core.sample_indices(LOOP0_S + LOST_RETRY_S) == [0, 1, 2, 3]
    node.read(now_s=LOOP0_S + LOST_RETRY_S)  # still gone: not published again
    assert len(node.events("gpu_lost")) == 1
    node.backend.restore_gpu(2)
    node.read(now_s=LOOP0_S + 2 * LOST_RETRY_S)
    assert [e.gpu for e in node.events("gpu_recovered")] == [2]
    assert node.core.lost == {}


def test_a_limit_moved_by_someone_else_is_put_back(tmp_path: Path) -> None:
    """A sample taken after polca's writes shows another power limit: with nothing else
    changed, the step plans the limit back, reported as ``cap_reasserted`` (the state is
    not republished); once written, older samples do not trigger it again."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.step(MONO0)
    default_mw = node.infos[0].power_limit_default_mw
    assert default_mw is not None
    moved = dataclasses.replace(node.core.latest[0], power_limit_mw=default_mw - 50_000)
    node.keep(node.core.note_samples([0], [moved], now_s=LOOP0_S, now_ns=wall(MONO0)).effects)
    states = len(node.states())
    plan = node.step(MONO0 + S // 10)
    assert plan.decision is not None  # the one in force, carried out again
    assert (plan.taken, plan.targets_changed) == (False, False)
    assert [w for p in plan.writes for w in p.writes] == [SetPowerLimit(0, default_mw)]
    (event,) = node.events("cap_reasserted")
    (gpu,) = detail(event)["gpus"]
    assert gpu["changes"][0] == f"power_limit_drift:{default_mw - 50_000}"
    assert len(node.states()) == states  # the caps in force did not change: no new state
    assert node.step(MONO0 + 2 * S // 10).writes == ()


# ---------------------------------------------------------------- fail-safe and grace


def test_a_lapsed_lease_enters_the_fail_safe_and_a_new_control_leaves_it(tmp_path: Path) -> None:
    """Level 0 with a 10 s lease: nominal, then at its end the fail-safe caps (T2), with
    ``fail_safe_entered`` stamped at the step's time; a new control leaves it."""
    node = Node(tmp_path)
    node.control(0, mono=MONO0)
    assert locks(node.step(MONO0)) == {}
    plan = node.step(MONO0 + 10 * S)
    assert plan.decision is not None
    assert plan.decision.fail_safe
    assert locks(plan) == t2_locks(node)
    (entered,) = node.events("fail_safe_entered")
    assert entered.ts_ns == wall(MONO0 + 10 * S)
    assert node.states()[-1].fail_safe
    assert "fail-safe" in node.status_lines[-1]
    node.control(0, mono=MONO0 + 11 * S)
    node.step(MONO0 + 11 * S)
    (left,) = node.events("fail_safe_left")
    assert left.detail == {"level": 0}
    assert not node.states()[-1].fail_safe


def test_the_startup_grace_is_nominal_until_it_ends(tmp_path: Path) -> None:
    """No controller heard from: nominal until the grace passed in ends, then fail-safe."""
    node = Node(tmp_path, grace_s=10.0)
    plan = node.step(MONO0)
    assert plan.decision is not None
    assert (plan.decision.level, plan.decision.fail_safe) == (0, False)
    assert node.step(MONO0 + 10 * S - 1).decision is None
    plan = node.step(MONO0 + 10 * S)
    assert plan.decision is not None
    assert plan.decision.fail_safe


def test_a_baseline_left_behind_puts_the_fail_safe_on_first(tmp_path: Path) -> None:
    """At a start after a run that did not restore: every clock relocked to the fail-safe
    caps (polca cannot read its old locks back), no grace, and the baseline found stays
    the originals to save."""
    node = Node(tmp_path, grace_s=10.0)
    original = Baseline.capture(node.infos, list(node.samples.values()), now_ns=1)
    left = dataclasses.replace(original, saved_ns=WALL0 - 3600 * S)
    plan = node.core.resume(left, now_mono_ns=MONO0)
    assert plan.decision.fail_safe
    assert not plan.kept
    assert locks(plan.writes) == t2_locks(node)
    node.keep(node.core.note_resume(plan, node.write(plan.writes), now_ns=wall(MONO0)))
    (line,) = node.lines("fail_safe_applied_at_start", "warning")
    assert (line["applied"], line["failed"], line["lost"]) == (4, 0, 0)
    assert line["path"] == str(tmp_path / "baseline.json")
    assert node.core.decision is not None
    assert node.core.decision.fail_safe
    assert node.core.grace_until_mono_ns <= MONO0  # no grace after an unclean end
    plan_after = node.step(MONO0 + S)  # the first step decides: still the fail-safe
    assert plan_after.decision is not None
    assert plan_after.decision.fail_safe
    assert (plan_after.writes, plan_after.targets_changed) == ((), False)
    kept = node.core.capture_baseline(list(node.samples.values()), now_ns=2)
    assert kept.saved_ns == left.saved_ns


# ---------------------------------------------------------------- the end of control


def _locked_at_level_2(tmp_path: Path, **kwargs: Any) -> Node:
    node = Node(tmp_path, **kwargs)
    node.core.capture_baseline(list(node.samples.values()), now_ns=2)
    node.control(2, mono=MONO0)
    node.step(MONO0)
    return node


def test_a_clean_stop_with_on_stop_restore_unlocks_and_drops_the_baseline(
    tmp_path: Path,
) -> None:
    """``on_stop: restore``: every GPU back to its original settings; the saved baseline
    is done with once all of them are."""
    node = _locked_at_level_2(tmp_path, on_stop="restore")
    plan = node.core.plan_stop(clean=True, now_mono_ns=MONO0 + S)
    assert (plan.mode, plan.reason, plan.save) == ("restore", "stopped", None)
    assert [w for p in plan.writes for w in p.writes] == [ResetSmClocks(i) for i in range(4)]
    stopped = node.core.note_stop(plan, node.write(plan.writes), timeout_s=5.0, now_ns=WALL0)
    assert (stopped.reason, stopped.remove_baseline) == ("stopped", True)
    assert node.keep(stopped.effects).logs[0].event == "gpu_settings_restored"
    assert all(node.backend.held(i)[0] is None for i in range(4))


def test_a_restore_that_fails_on_one_gpu_keeps_the_baseline(tmp_path: Path) -> None:
    """One GPU not restored: the baseline file stays for the next start."""
    node = _locked_at_level_2(tmp_path, on_stop="restore")
    plan = node.core.plan_stop(clean=True, now_mono_ns=MONO0 + S)
    results = node.write(plan.writes)
    results[3] = [WriteResult(plan.writes[3].writes[0], GpuError("busy", index=3))]
    stopped = node.core.note_stop(plan, results, timeout_s=5.0, now_ns=WALL0)
    assert not stopped.remove_baseline
    assert node.keep(stopped.effects).logs[0].fields == {"restored": 3, "failed": 1}


@pytest.mark.parametrize("clean", [True, False])
def test_on_stop_fail_safe_and_any_unclean_end_leave_the_fail_safe(
    tmp_path: Path, clean: bool
) -> None:
    """``on_stop: fail_safe`` (clean) and a failure under ``on_stop: restore`` (unclean)
    both plan the fail-safe caps and keep the baseline, kept on purpose only when clean."""
    node = _locked_at_level_2(tmp_path, on_stop="fail_safe" if clean else "restore")
    node.control(0, mono=MONO0 + S)
    node.step(MONO0 + S)  # level 0: unlocked
    plan = node.core.plan_stop(clean=clean, now_mono_ns=MONO0 + 2 * S)
    assert plan.mode == "fail_safe"
    assert plan.reason == ("stopped" if clean else "failed")
    assert plan.save is not None
    assert plan.save.kept is clean
    assert locks(plan.writes) == t2_locks(node)
    stopped = node.core.note_stop(
        plan, node.write(plan.writes), timeout_s=5.0, now_ns=wall(MONO0 + 2 * S)
    )
    assert not stopped.remove_baseline
    node.keep(stopped.effects)
    name, level = (
        ("gpu_fail_safe_on_stop", "info") if clean else ("gpu_fail_safe_on_failure", "error")
    )
    (line,) = node.lines(name, level)
    assert line["applied"] == 4
    assert node.core.decision is not None
    assert node.core.decision.fail_safe
    assert node.events("fail_safe_entered")[-1].ts_ns == wall(MONO0 + 2 * S)


def test_the_fail_safe_at_the_end_keeps_tighter_caps_in_force(tmp_path: Path) -> None:
    """Stopping at the brake level: the fail-safe (T2) would loosen it, so the brake's
    caps stay."""
    node = _locked_at_level_2(tmp_path, on_stop="fail_safe")
    node.control(3, mono=MONO0 + S)
    brake = locks(node.step(MONO0 + S))
    plan = node.core.plan_stop(clean=True, now_mono_ns=MONO0 + 2 * S)
    assert plan.decision is not None
    assert {t.sm_clock_max_mhz for t in plan.decision.targets} == {288}
    assert locks(plan.writes) == {}  # already there
    assert set(brake.values()) == {snapped(node, 288)}


def test_on_stop_keep_saves_the_baseline_as_kept_and_writes_nothing(tmp_path: Path) -> None:
    """``on_stop: keep``: the caps stay, the baseline is saved as kept on purpose."""
    node = _locked_at_level_2(tmp_path, on_stop="keep")
    plan = node.core.plan_stop(clean=True, now_mono_ns=MONO0 + S)
    assert (plan.mode, plan.writes) == ("keep", ())
    assert plan.save is not None
    assert plan.save.kept
    stopped = node.core.note_stop(plan, [], timeout_s=5.0, now_ns=WALL0)
    assert node.keep(stopped.effects).logs[0].event == "gpu_caps_kept"


def test_a_stop_past_its_bound_says_so_in_the_reason(tmp_path: Path) -> None:
    """The shell's bound ran out before the writes were done: the final status says so
    and the baseline stays."""
    node = _locked_at_level_2(tmp_path)
    plan = node.core.plan_stop(clean=True, now_mono_ns=MONO0 + S)
    stopped = node.core.note_stop(plan, None, timeout_s=5.0, now_ns=WALL0)
    assert stopped.reason == "stopped; restore timed out"
    assert not stopped.remove_baseline
    assert node.keep(stopped.effects).logs[0].level == "error"


def test_observe_only_ends_without_touching_the_gpus(tmp_path: Path) -> None:
    """Observe-only: nothing to save, nothing to write at the end."""
    node = Node(tmp_path, observe_only=True, on_stop="fail_safe")
    plan = node.core.plan_stop(clean=False, now_mono_ns=MONO0)
    assert (plan.mode, plan.save, plan.writes) == ("none", None, ())
    stopped = node.core.note_stop(plan, [], timeout_s=5.0, now_ns=WALL0)
    assert (stopped.reason, stopped.remove_baseline, stopped.effects) == (
        "failed",
        False,
        Effects(),
    )


# ---------------------------------------------------------------- messages and their seq


def test_every_numbered_message_takes_the_next_seq(tmp_path: Path) -> None:
    """Events, states and telemetry share one ascending ``seq`` from 1, in publishing
    order; a status carries none and does not take one."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.step(MONO0)  # cap_changed, state
    node.published.append(node.core.status_message("online", now_ns=WALL0))
    node.published.append(node.core.state_message(now_ns=WALL0, now_mono_ns=MONO0))
    window = TelemetryWindow(dict(node.core.infos))
    for sample in node.read(now_s=LOOP0_S + 1).values():
        window.add(sample)
    health = Health.of(ticks=1, tick_durations_s=[0.001], gpu_call_p99_s=None, bus=None, rejected=0)
    message, effects = node.core.telemetry(
        window, health=health, now_ns=wall(MONO0 + S), now_s=LOOP0_S + 1
    )
    (out,) = node.keep(effects).messages
    assert node.seqs() == [1, 2, 3, 4]
    assert node.core.seq == 4
    assert isinstance(decode(out.payload), Telemetry)
    assert (message.seq, message.ts_ns, message.level) == (4, wall(MONO0 + S), 2)
    assert [g.locked_sm_clock_max_mhz for g in message.gpus] == list(t2_locks(node).values())


def test_a_reading_the_wire_refuses_is_nulled_and_logged_once(tmp_path: Path) -> None:
    """A GPU temperature of 500 C in the interval: the telemetry still goes out, that
    reading null, and its warning comes back with the message (once per GPU and field)."""
    node = Node(tmp_path)
    window = TelemetryWindow(dict(node.core.infos))
    health = Health.of(ticks=1, tick_durations_s=[], gpu_call_p99_s=None, bus=None, rejected=0)
    for _ in range(2):
        window.add(dataclasses.replace(node.samples[1], gpu_temp_c=500.0))
        message, effects = node.core.telemetry(window, health=health, now_ns=WALL0, now_s=LOOP0_S)
        node.keep(effects)
        assert message.gpus[1].gpu_temp_c is None
        assert [decode(m.payload, Telemetry).seq for m in effects.messages] == [message.seq]
    warnings = node.lines("gpu_reading_invalid", "warning")
    assert [(w["gpu"], w["field"]) for w in warnings] == [(1, "gpu_temp_c"), (1, "gpu_temp_max_c")]


def test_an_event_that_does_not_fit_the_wire_is_logged_and_its_seq_skipped(
    tmp_path: Path,
) -> None:
    """A driver error too long for the wire: that ``gpu_lost`` event is not published (a
    warning says so), and the next message's seq still ascends past it."""
    node = Node(tmp_path)
    results: list[GpuSample | GpuError] = [
        node.backend.sample(0),
        GpuLostError("x" * 5000, index=1),
        GpuLostError("gone", index=2),
        node.backend.sample(3),
    ]
    sampled = node.core.note_samples([0, 1, 2, 3], results, now_s=LOOP0_S, now_ns=WALL0)
    node.keep(sampled.effects)
    assert sorted(sampled.samples) == [0, 3]
    assert [line.event for line in sampled.effects.logs] == [
        "gpu_lost",
        "event_not_published",
        "gpu_lost",
    ]
    assert [(e.gpu, e.seq) for e in node.events("gpu_lost")] == [(2, 2)]
    assert set(node.core.lost) == {1, 2}


def test_messages_caused_by_a_message_carry_its_receipt_time(tmp_path: Path) -> None:
    """A valid policy bundle from the aggregator: ``policy_applied`` and the new status,
    stamped with the bundle's receipt time; the text comes back to keep as a copy."""
    node = Node(tmp_path)
    text = node.core.policy_store.path.read_text(encoding="utf-8") + "# pushed\n"
    bundle = PolicyBundle(
        ts_ns=WALL0, name="polca-a100", revision=revision_of(text.encode()), text=text
    )
    mono = MONO0 + 7 * S
    received = node.core.receive(
        InMessage(
            TOPICS.policy("dc1", "row1"),
            encode(bundle),
            retain=True,
            received_ns=wall(mono),
            received_mono_ns=mono,
        )
    )
    node.keep(received.effects)
    assert received.wake
    assert received.policy_copy == text
    (event,) = node.events("policy_applied")
    assert event.ts_ns == wall(mono)
    (status,) = [decode(m.payload, Status) for m in node.on("status")]
    assert (status.ts_ns, status.policy_revision) == (wall(mono), bundle.revision)
    assert received.effects.status_line is not None


def test_a_skewed_controller_clock_republishes_the_status(tmp_path: Path) -> None:
    """A control stamped 60 s behind this node's clock: still followed (it wakes the
    controller), one ``clock_skew_detected`` event, and the status says the skew."""
    node = Node(tmp_path)
    assert node.control(2, mono=MONO0, issued_ns=WALL0 - 60 * S)
    (event,) = node.events("clock_skew_detected")
    assert event.detail["skew_s"] == 60.0
    (status,) = [decode(m.payload, Status) for m in node.on("status")]
    assert status.clock_skew_s == 60.0
    assert "clock off by +60.0 s" in node.status_lines[-1]


def test_bad_payloads_are_counted_and_logged_by_their_receipt_time(tmp_path: Path) -> None:
    """Garbage on the control topic: counted, nothing published; its warning at most once
    per 10 s of the receipt times passed in, the next one saying how many it covers."""
    node = Node(tmp_path)
    topic = TOPICS.row_control("dc1", "row1")
    for mono in (MONO0, MONO0 + S, MONO0 + 9 * S, MONO0 + 10 * S):
        assert not node.receive(topic, b"{not json", mono=mono)
    assert node.core.drops.total == 4
    assert node.published == []
    lines = node.lines("message_rejected", "warning")
    assert [(line["reason"], line["dropped"], line["total"]) for line in lines] == [
        ("malformed", 1, 1),
        ("malformed", 3, 4),
    ]


def test_a_snapshot_does_not_follow_the_core(tmp_path: Path) -> None:
    """What the message builders read is a copy: later decisions and failures do not
    change it, and it cannot be changed."""
    node = Node(tmp_path)
    node.control(2, mono=MONO0)
    node.step(MONO0)
    snapshot = node.core.snapshot()
    node.core.outcome_errors[1] = "boom"
    node.control(0, mono=MONO0 + S)
    node.step(MONO0 + S)
    assert snapshot.level == 2
    assert 1 not in snapshot.outcome_errors
    assert snapshot.locked_sm_clock_max_mhz[1] == snapped(node, LOW_T2_MHZ)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.decision = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        snapshot.outcome_errors[2] = "no"  # type: ignore[index]


def test_the_message_builders_and_the_gpu_shell_do_not_import_the_core() -> None:
    """Decisions flow one way: core -> its parts, messages, plans; the parts, the shell's
    GPU side and the builders never reach back into the core (no cycle)."""
    graph = grimp.build_graph("polca")
    assert graph.find_shortest_chain("polca.agent.core", "polca.agent.messages") is not None
    for module in (
        "polca.agent.messages",
        "polca.agent.points",
        "polca.agent.plans",
        "polca.agent.gpus",
        "polca.agent.fleet",
        "polca.agent.step",
        "polca.agent.ending",
        "polca.agent.outbox",
        "polca.agent.intake",
    ):
        assert graph.find_shortest_chain(module, "polca.agent.core") is None, module


# ---------------------------------------------------------------- the connection


def test_a_new_connection_publishes_status_naming_its_endpoint_then_the_state(
    tmp_path: Path,
) -> None:
    """``birth``: the online status (with the endpoint it is for), then the state."""
    node = Node(tmp_path)
    status, state = node.core.birth("nats-2:8883", now_ns=WALL0, now_mono_ns=MONO0)
    assert status.topic.endswith("/status")
    assert state.topic.endswith("/state")
    assert (status.retain, state.retain) == (True, True)
    assert decode(status.payload, Status).mqtt_endpoint == "nats-2:8883"
    assert node.core.mqtt_endpoint == "nats-2:8883"


def test_while_disconnected_every_message_but_the_status_is_queued() -> None:
    """A status queued while disconnected would follow the next birth's and state an old
    status: it is left out then (the birth carries the status as it is); all else waits."""
    status = OutMessage("polca/v1/dc1/r/k/n/status", b"s", qos=1, retain=True)
    state = OutMessage("polca/v1/dc1/r/k/n/state", b"t", qos=1, retain=True)
    effects = Effects(messages=(status, state))
    topic = status.topic
    assert effects.to_send(status_topic=topic, connected=True) == [status, state]
    assert effects.to_send(status_topic=topic, connected=False) == [state]


def test_the_policy_file_is_not_reloaded_while_the_aggregators_is_in_force(
    tmp_path: Path,
) -> None:
    """A reload of the local file is refused with a warning while the aggregator's policy
    is in force, allowed otherwise."""
    node = Node(tmp_path)
    assert node.core.policy_file_ignored("sighup") is None
    node.core.remote_policy = True
    ignored = node.core.policy_file_ignored("sighup")
    assert ignored is not None
    (line,) = ignored.logs
    assert (line.level, line.event, line.fields["trigger"]) == (
        "warning",
        "policy_file_ignored",
        "sighup",
    )
    classes = node.core.policy_classes()
    assert classes.order == tuple(node.core.policy.policy.classes)
    assert classes.default == node.core.policy.policy.default_class
