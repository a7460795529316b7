"""The node agent's supervisor: one TaskGroup owning every loop, ordered start and stop.

Start-up order: note the run in the exit record (a crash loop is reported) -> open the GPU
backend on its worker thread -> discover GPUs -> check write privilege (unless
observe-only) -> load the policy -> if a baseline was left behind (a crash, or a stop that
kept caps), keep it as the originals and apply the fail-safe caps before anything else ->
save the baseline -> start MQTT and the loops -> tell systemd READY=1. The start-up grace
(nominal until the first control message) applies only after a clean, restoring stop.

Tasks (all under ``aiokit.guard``): ``mqtt`` (connect loop, outlives the rest so the final
status goes out), ``sampler`` (10 Hz reads), ``controller`` (engine decision and actuation,
woken by each tick, each accepted control message and each policy change), ``publisher``
(one telemetry message per interval), ``listener`` (control and priority assignment),
``policy_watcher`` (file changes and SIGHUP), ``watchdog`` (systemd, fed only while the
controller makes progress).

Shutdown order: stop the loops -> on a clean, operator-asked stop, what ``on_stop`` says
(restore the originals, keep the caps, or apply the fail-safe caps); on any other end (a
task failed, a fatal error) the fail-safe caps or the caps in force, whichever is tighter
(shielded, bounded by ``agent.stop_timeout_s``) -> publish the final state and an
``offline`` status, flush (bounded) -> close the GPU backend -> note how the run ended.

Every received message is handled on its own inside a guard (``handle_message``): a bad
one is counted by reason and dropped, and no message can end the listener.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from polca import __version__, aiokit
from polca.agent.actuator import Actuator, ApplyResult, Setting
from polca.agent.baseline import Baseline, BaselineStore
from polca.agent.control import REFUSED, ControlTracker
from polca.agent.window import TelemetryWindow
from polca.errors import FatalError, GpuError, GpuLostError, PolicyError, SchemaError
from polca.exits import ExitRecord, Streak
from polca.gpu.backend import GpuBackend, GpuInfo, GpuSample
from polca.gpu.threaded import ThreadedGpu
from polca.policy import (
    ControlInput,
    Decision,
    EngineState,
    GpuTarget,
    GpuView,
    LoadedPolicy,
    PolicyStore,
    decide,
    tighter,
)
from polca.policy.loader import revision_of
from polca.sdnotify import SystemdNotifier, WatchdogGate
from polca.settings import Settings
from polca.telemetry.bus import InMessage, MqttBus, OutMessage
from polca.telemetry.checks import ClockWindow, DropLog
from polca.telemetry.schema import (
    AgentHealth,
    Assignment,
    Control,
    Event,
    GpuCaps,
    PolicyBundle,
    State,
    Status,
    Telemetry,
    decode,
    encode,
)
from polca.telemetry.topics import NodeAddress, Topics

LOST_RETRY_S = 10.0
REMOTE_POLICY_FILE = "policy.remote.yaml"


@dataclass(slots=True)
class _Counters:
    ticks: int = 0
    tick_durations_s: list[float] = field(default_factory=list)
    control_rejected: int = 0
    seq: int = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def tick_p99_ms(self) -> float | None:
        if not self.tick_durations_s:
            return None
        ordered = sorted(self.tick_durations_s)
        return round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3)


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
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.policy_store = policy_store
        self.notifier = notifier or SystemdNotifier()
        self.clock_ns = clock_ns  # wall clock: stamps and display only
        self.mono_ns = mono_ns  # leases, grace, every duration
        t = settings.topics
        self.addr = NodeAddress(t.site, t.row, t.rack, t.node)
        self.topics = Topics(t.root)
        self.log = structlog.get_logger().bind(node=t.node)
        self.gpu = ThreadedGpu(backend, call_timeout_s=settings.gpu.call_timeout_s)
        self.clock_window = ClockWindow.of_seconds(settings.agent.clock_skew_tolerance_s)
        self.tracker = ControlTracker(
            row=t.row,
            rack=t.rack,
            window=self.clock_window,
            issuers=frozenset(settings.agent.control_issuers),
        )
        self.drops = DropLog("message_rejected", logger=self.log)
        self.exits = ExitRecord(settings.agent.state_dir, clock_ns=clock_ns, logger=self.log)
        self.crash_loop: Streak | None = None
        self.clock_skewed = False
        self.gate = WatchdogGate()
        self.reload_requested = asyncio.Event()
        self.remote_policy = False  # the aggregator's policy is in force
        self.stop_requested = asyncio.Event()
        self.counters = _Counters()
        self.infos: dict[int, GpuInfo] = {}
        self.latest: dict[int, GpuSample] = {}
        # Samples taken since the last write: only these can show that something else
        # changed a limit (older ones may predate polca's own write).
        self.fresh: dict[int, GpuSample] = {}
        self.lost: dict[int, float] = {}  # index -> loop time of the last attempt
        self.runtime_classes: dict[str, str] = {}  # uuid or index -> class (MQTT assignment)
        self.engine_state = EngineState()
        self.decision: Decision | None = None
        self.last_targets: tuple[GpuTarget, ...] = ()
        self.last_outcome_errors: dict[int, str] = {}
        self.baseline: Baseline | None = None
        self.baseline_store = BaselineStore(settings.agent.state_dir)
        self.actuator: Actuator | None = None
        self.wrote = False
        self.started_ns = clock_ns()
        self.started_mono_ns = mono_ns()
        self.grace_until_mono_ns = self.started_mono_ns + int(settings.agent.startup_grace_s * 1e9)
        self._wake = asyncio.Event()
        self._last_key: tuple[object, ...] | None = None
        self.window: TelemetryWindow | None = None
        self.bus: MqttBus | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def policy(self) -> LoadedPolicy:
        """The policy in force (the last good one)."""
        current = self.policy_store.current
        if current is None:
            msg = "no valid policy loaded"
            raise FatalError(msg)
        return current

    async def run(self) -> None:
        """Start, run until ``stop_requested`` is set, then shut down in order."""
        self._note_start()
        with self.exits.recording():
            await self.gpu.start()
            try:
                await self._startup()
                await self._supervise()
            finally:
                await self._close_gpu()

    def _note_start(self) -> None:
        """Record that a run begins; report a crash loop when the same failure repeats."""
        self.crash_loop = self.exits.start_reporting(
            crash_loop_after=self.settings.agent.crash_loop_after
        )
        if self.crash_loop is not None:
            self.notifier.status(self.crash_loop.text)

    def _crash_loop_text(self) -> str | None:
        return None if self.crash_loop is None else self.crash_loop.text

    async def _startup(self) -> None:
        infos = await self.gpu.discover()
        self.infos = {info.index: info for info in infos}
        for info in infos:
            self.log.info(
                "gpu_discovered",
                gpu=info.index,
                uuid=info.uuid,
                name=info.name,
                sm_clock_max_mhz=info.sm_clock_max_mhz,
                power_limit_default_mw=info.power_limit_default_mw,
            )
        self.window = TelemetryWindow(dict(self.infos))
        observe = self.settings.agent.observe_only
        if not observe:
            await self.gpu.check_write_access()
        samples = await self._sample_once()
        self.actuator = Actuator(
            self.backend, dict(self.infos), reassert=self.settings.agent.reassert
        )
        self.actuator.adopt(list(samples.values()))
        self._load_policy()
        if not observe:
            # Before anything else: a run that did not restore leaves at least fail-safe caps.
            await self._resume_after_unclean_end()
            await self._save_baseline(samples)
        if not self.settings.agent.control_issuers:
            self.log.warning(
                "control_issuer_unchecked",
                hint="set agent.control_issuers to the aggregator instance(s) of this row",
            )

    def _load_policy(self) -> None:
        """The aggregator's last good copy if there is one, else the policy file."""
        if self.settings.agent.accept_remote_policy and self.remote_policy_path.is_file():
            remote = self.policy_store.replace(
                self.remote_policy_path.read_text(encoding="utf-8"),
                source=str(self.remote_policy_path),
            )
            self.remote_policy = remote.ok
            if not remote.ok:
                self.log.error(
                    "policy_copy_invalid",
                    path=str(self.remote_policy_path),
                    problems=list(remote.errors),
                )
        if self.policy_store.current is None:
            result = self.policy_store.reload()
            if self.policy_store.current is None:
                problems = "; ".join(result.errors) if result.errors else "unknown error"
                msg = f"policy {self.settings.agent.policy_file} is invalid: {problems}"
                raise PolicyError(msg, problems=tuple(result.errors))
        self.log.info(
            "policy_loaded",
            policy=self.policy.policy.name,
            revision=self.policy.revision,
            path=str(self.policy.path),
        )

    async def _resume_after_unclean_end(self) -> None:
        """Apply the fail-safe caps first when a previous run did not restore the GPUs.

        A baseline left behind means the previous run crashed, was killed, or stopped on
        purpose without restoring (``on_stop: keep`` or ``fail_safe``). Its values are still
        the originals (the GPUs now hold polca's caps), so they stay the baseline; the GPUs
        get the fail-safe caps before MQTT or any loop starts, and there is no start-up
        grace: they stay at or under the fail-safe until a controller grants a lease.
        """
        existing = self.baseline_store.load()
        if existing is None:
            return
        self.baseline = Baseline(existing.gpus, existing.saved_ns, kept=False)
        self.grace_until_mono_ns = self.started_mono_ns  # no grace after an unclean end
        # After an unclean end polca does not know which clock locks it left: relock all.
        assert self.actuator is not None  # noqa: S101 - set by _startup
        for index, setting in list(self.actuator.applied.items()):
            self.actuator.applied[index] = Setting((0, 0), setting.power_limit_mw)
        decision = self._fail_safe_decision()
        result = await self.gpu.run(
            partial(self.actuator.apply, decision.targets, baseline=self.baseline, samples={})
        )
        self.decision = decision
        self.engine_state = decision.state
        self.last_targets = decision.targets
        self.wrote = True
        self.log.warning(
            "fail_safe_applied_at_start",
            reason="kept caps" if existing.kept else "the previous run ended without restoring",
            path=str(self.baseline_store.path),
            applied=len(result.by_action("applied")),
            failed=len(result.by_action("failed")),
            lost=len(result.by_action("lost")),
        )

    def _fail_safe_decision(self) -> Decision:
        """The fail-safe caps merged with the caps in force: per dimension the tighter."""
        decision = decide(
            self._views(),
            policy=self.policy.policy,
            control=None,
            state=self.engine_state,
            now_ns=self.mono_ns(),
        )
        current = {t.index: t for t in self.last_targets}
        targets = tuple(
            tighter(t, current[t.index]) if t.index in current else t for t in decision.targets
        )
        return Decision(targets=targets, state=decision.state, level=0, fail_safe=True)

    async def _save_baseline(self, samples: dict[int, GpuSample]) -> None:
        """Save the original settings before the first write."""
        if self.baseline is None:
            self.baseline = Baseline.capture(list(self.infos.values()), list(samples.values()))
        self.baseline_store.save(self.baseline)

    async def _supervise(self) -> None:
        self.bus = self._make_bus()
        self.notifier.ready(self._status_line())
        async with asyncio.TaskGroup() as outer:
            # Not guarded: run() returns by design once close() has said goodbye.
            bus_task = outer.create_task(self.bus.run(), name="mqtt")
            clean = False
            try:
                await aiokit.run_until_stopped(
                    {
                        "sampler": self._sampler(),
                        "controller": self._controller(),
                        "publisher": self._publisher(),
                        "listener": self._listener(),
                        "policy_watcher": self._policy_watcher(),
                        "sighup": self._sighup(),
                        "watchdog": self._watchdog(),
                    },
                    self.stop_requested,
                )
                self.log.info("agent_stopping")
                clean = True
            finally:
                await asyncio.shield(self._shutdown(clean=clean))
                bus_task.cancel()

    async def _shutdown(self, *, clean: bool) -> None:
        """Leave the GPUs as the stop requires, publish the final state and status; bounded.

        ``clean`` is an operator-asked stop: ``on_stop`` decides. Anything else (a task
        failed, a fatal error) leaves the fail-safe caps or the caps in force, whichever is
        tighter, and keeps the baseline so the next start applies the fail-safe first.
        """
        self.notifier.stopping()
        reason = "stopped" if clean else "failed"
        if self.actuator is not None and not self.settings.agent.observe_only:
            current = self.policy_store.current
            on_stop = current.policy.on_stop if current else "restore"
            if not clean:
                on_stop = "fail_safe"
            try:
                async with asyncio.timeout(self.settings.agent.stop_timeout_s):
                    if on_stop == "restore":
                        await self._restore_on_stop()
                    elif on_stop == "fail_safe" and current is not None:
                        await self._fail_safe_on_stop(clean=clean)
                    elif self.baseline is not None:
                        kept = Baseline(self.baseline.gpus, self.baseline.saved_ns, kept=True)
                        self.baseline_store.save(kept)
                        self.log.info("gpu_caps_kept", path=str(self.baseline_store.path))
            except TimeoutError:
                self.log.error(
                    "restore_timed_out",
                    timeout_s=self.settings.agent.stop_timeout_s,
                    baseline=str(self.baseline_store.path),
                )
                reason = "stopped; restore timed out"
        if self.bus is not None:
            final = [self._status_message("offline", reason=reason)]
            try:
                async with asyncio.timeout(2.0):
                    await self.bus.close(final=final)
            except TimeoutError:
                self.log.warning("final_status_not_sent")

    async def _restore_on_stop(self) -> None:
        assert self.actuator is not None  # noqa: S101 - checked by the caller
        result = await self.gpu.run(partial(self.actuator.restore, self.baseline))
        failed = result.by_action("failed")
        if not failed:
            self.baseline_store.remove()
        self.log.info(
            "gpu_settings_restored",
            restored=len(result.by_action("applied")),
            failed=len(failed),
        )

    async def _fail_safe_on_stop(self, *, clean: bool) -> None:
        """Apply the fail-safe caps (or keep tighter ones) and keep the baseline."""
        assert self.actuator is not None  # noqa: S101 - checked by the caller
        if self.baseline is not None:
            kept = Baseline(self.baseline.gpus, self.baseline.saved_ns, kept=clean)
            self.baseline_store.save(kept)
        decision = self._fail_safe_decision()
        result = await self.gpu.run(
            partial(self.actuator.apply, decision.targets, baseline=self.baseline, samples={})
        )
        (self.log.info if clean else self.log.error)(
            "gpu_fail_safe_on_stop" if clean else "gpu_fail_safe_on_failure",
            applied=len(result.by_action("applied")),
            unchanged=len(result.by_action("unchanged")),
            failed=len(result.by_action("failed")),
            caps=[
                {
                    "gpu": t.index,
                    "sm_clock_max_mhz": t.sm_clock_max_mhz,
                    "power_limit_mw": t.power_limit_mw,
                }
                for t in decision.targets
            ],
        )
        self.last_targets = decision.targets
        self.decision = decision

    async def _close_gpu(self) -> None:
        try:
            async with asyncio.timeout(self.settings.agent.stop_timeout_s):
                await self.gpu.aclose()
        except TimeoutError:
            self.log.error("gpu_close_timed_out")

    # ------------------------------------------------------------------ MQTT

    def _make_bus(self) -> MqttBus:
        t = self.settings.topics
        client_id = self.settings.mqtt.client_id or f"polca-agent-{t.node}"
        will = OutMessage(
            self.topics.node(self.addr, "status"),
            encode(self._status("offline", reason="connection lost")),
            qos=1,
            retain=True,
        )
        subscriptions = [
            (self.topics.row_control(t.site, t.row), 1),
            (self.topics.rack_control(t.site, t.row, t.rack), 1),
            (self.topics.node(self.addr, "assign"), 1),
        ]
        if self.settings.agent.accept_remote_policy:
            subscriptions.append((self.topics.policy(t.site, t.row), 1))
        return MqttBus(
            self.settings.mqtt,
            client_id=client_id,
            will=will,
            subscriptions=subscriptions,
            birth=lambda: [self._status_message("online"), self._state_message()],
            clock_ns=self.clock_ns,
            mono_ns=self.mono_ns,
        )

    def _status(self, state: str, *, reason: str | None = None) -> Status:
        current = self.policy_store.current
        return Status(
            ts_ns=self.clock_ns(),
            state=state,
            node=self.addr.node,
            agent_version=__version__,
            backend=self.settings.gpu.backend,
            gpu_count=len(self.infos),
            observe_only=self.settings.agent.observe_only,
            policy_name=current.policy.name if current else None,
            policy_revision=current.revision if current else None,
            started_ns=self.started_ns,
            reason=reason if reason is not None or state == "offline" else self._crash_loop_text(),
            clock_skew_s=self._skew_s() if self.clock_skewed else None,
        )

    def _skew_s(self) -> float | None:
        skew_ns = self.tracker.skew_ns
        return None if skew_ns is None else round(skew_ns / 1e9, 3)

    def _status_message(self, state: str, *, reason: str | None = None) -> OutMessage:
        return OutMessage(
            self.topics.node(self.addr, "status"),
            encode(self._status(state, reason=reason)),
            qos=1,
            retain=True,
        )

    def _state_message(self) -> OutMessage:
        decision = self.decision
        now_mono = self.mono_ns()
        lease = self.tracker.current(now_mono)
        gpus = []
        for target in self.last_targets:
            limit = target.power_limit_mw
            gpus.append(
                GpuCaps(
                    index=target.index,
                    uuid=target.uuid,
                    priority_class=target.priority_class,
                    sm_clock_max_mhz=target.sm_clock_max_mhz,
                    power_limit_w=None if limit is None else limit / 1000.0,
                    reasons=target.reasons,
                    applied=not self.settings.agent.observe_only
                    and target.index not in self.last_outcome_errors,
                    error=self.last_outcome_errors.get(target.index),
                )
            )
        state = State(
            ts_ns=self.clock_ns(),
            seq=self.counters.next_seq(),
            node=self.addr.node,
            level=decision.level if decision else 0,
            fail_safe=decision.fail_safe if decision else False,
            observe_only=self.settings.agent.observe_only,
            # Display only: the lease's end on this node's wall clock.
            lease_expires_ns=max(0, self.clock_ns() + lease.expires_mono_ns - now_mono)
            if lease
            else None,
            control_seq=lease.control.seq if lease else None,
            policy_revision=self.policy_store.current.revision
            if self.policy_store.current
            else None,
            gpus=tuple(gpus),
        )
        return OutMessage(self.topics.node(self.addr, "state"), encode(state), qos=1, retain=True)

    def _event(self, name: str, *, gpu: int | None = None, **detail: Any) -> None:
        uuid = self.infos[gpu].uuid if gpu is not None and gpu in self.infos else None
        try:
            event = Event(
                ts_ns=self.clock_ns(),
                seq=self.counters.next_seq(),
                node=self.addr.node,
                event=name,
                gpu=gpu,
                uuid=uuid,
                detail=detail,
            )
        except ValueError as exc:  # pydantic's ValidationError: a detail out of bounds
            self.log.warning("event_not_published", event_name=name, error=str(exc)[:400])
            return
        if self.bus is not None:
            self.bus.publish_nowait(
                OutMessage(self.topics.node(self.addr, "events"), encode(event), qos=1)
            )

    def _status_line(self) -> str:
        decision = self.decision
        level = decision.level if decision else 0
        mode = "fail-safe" if decision and decision.fail_safe else f"level {level}"
        lost = f", {len(self.lost)} lost" if self.lost else ""
        skew = f", clock off by {self._skew_s():+.1f} s" if self.clock_skewed else ""
        loop = f"; {text}" if (text := self._crash_loop_text()) else ""
        revision = self.policy_store.current.revision if self.policy_store.current else "none"
        return f"{len(self.infos)} GPUs{lost}, {mode}, policy {revision}{skew}{loop}"

    # ------------------------------------------------------------------ loops

    async def _sample_once(self) -> dict[int, GpuSample]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        indices = [
            i for i in self.infos if i not in self.lost or now - self.lost[i] >= LOST_RETRY_S
        ]
        results = await self.gpu.sample_all(indices)
        samples: dict[int, GpuSample] = {}
        for index, result in zip(indices, results, strict=True):
            if isinstance(result, GpuSample):
                samples[index] = result
                if index in self.lost:
                    del self.lost[index]
                    self.log.warning("gpu_recovered", gpu=index)
                    self._event("gpu_recovered", gpu=index)
            elif isinstance(result, GpuLostError):
                self._mark_lost(index, str(result), now)
            else:
                self.log.warning("gpu_sample_failed", gpu=index, error=str(result))
        return samples

    def _mark_lost(self, index: int, error: str, now: float) -> None:
        if index not in self.lost:
            self.log.error("gpu_lost", gpu=index, uuid=self.infos[index].uuid, error=error)
            self._event("gpu_lost", gpu=index, error=error)
        self.lost[index] = now

    async def _sampler(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.agent.sample_interval_s
        next_t = loop.time()
        while True:
            await self.tick()
            next_t += interval
            delay = next_t - loop.time()
            if delay < 0:  # fell behind: skip missed ticks rather than burst
                next_t = loop.time()
                delay = 0
            await asyncio.sleep(delay)

    async def tick(self) -> None:
        """One sampling tick: read every GPU, then wake the controller."""
        start = time.perf_counter()
        samples = await self._sample_once()
        self.latest.update(samples)
        self.fresh.update(samples)
        assert self.window is not None  # noqa: S101 - set in _startup
        for sample in samples.values():
            self.window.add(sample)
        self.counters.ticks += 1
        durations = self.counters.tick_durations_s
        durations.append(time.perf_counter() - start)
        if len(durations) > 1000:
            del durations[:500]
        self._wake.set()

    async def _controller(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.control_step()
            self.gate.beat()

    def _control_input(self, now_mono_ns: int) -> ControlInput | None:
        """The control in force, with its lease on the monotonic clock (as ``now_mono_ns``)."""
        lease = self.tracker.current(now_mono_ns)
        if lease is not None:
            source = f"{lease.control.scope}:{lease.control.issuer}#{lease.control.seq}"
            return ControlInput(lease.control.level, lease.expires_mono_ns, source=source)
        if now_mono_ns < self.grace_until_mono_ns:
            # No controller heard from yet: nominal during the start-up grace period.
            return ControlInput(0, self.grace_until_mono_ns, source="startup_grace")
        return None

    def _views(self) -> list[GpuView]:
        views = []
        for index, info in sorted(self.infos.items()):
            if index in self.lost:
                continue
            sample = self.latest.get(index)
            cls = self.runtime_classes.get(info.uuid) or self.runtime_classes.get(str(index))
            supported = info.supported_sm_clocks_mhz
            views.append(
                GpuView(
                    index=index,
                    uuid=info.uuid,
                    priority_class=cls,
                    gpu_temp_c=sample.gpu_temp_c if sample else None,
                    mem_temp_c=sample.mem_temp_c if sample else None,
                    sm_clock_max_mhz=info.sm_clock_max_mhz,
                    sm_clock_min_mhz=min(supported) if supported else None,
                    power_limit_min_mw=info.power_limit_min_mw,
                    power_limit_max_mw=info.power_limit_max_mw,
                    power_limit_default_mw=info.power_limit_default_mw,
                )
            )
        return views

    def _decision_key(self, control: ControlInput | None, now_ns: int) -> tuple[object, ...]:
        """Everything the engine's output depends on: the lease only as valid or not."""
        temps = tuple((i, s.gpu_temp_c, s.mem_temp_c) for i, s in sorted(self.latest.items()))
        level = None if control is None else control.level
        valid = control is not None and control.lease_expires_ns > now_ns
        return (
            valid,
            self.policy.revision,
            level,
            tuple(sorted(self.runtime_classes.items())),
            tuple(sorted(self.lost)),
            temps,
        )

    async def control_step(self) -> ApplyResult | None:
        """Decide the caps for now and apply what changed; returns the apply outcome."""
        now_ns = self.mono_ns()  # the engine compares it with leases on the same clock
        previous = self.decision
        control = self._control_input(now_ns)
        key = self._decision_key(control, now_ns)
        if previous is not None and key == self._last_key:
            # Same inputs, same decision (the engine is pure): only check for drift.
            if self.settings.agent.observe_only or self.actuator is None:
                return None
            if not self.actuator.drifted(self.fresh):
                return None
            return await self._actuate(previous)
        self._last_key = key
        decision = decide(
            self._views(),
            policy=self.policy.policy,
            control=control,
            state=self.engine_state,
            now_ns=now_ns,
        )
        self.engine_state = decision.state
        self.decision = decision
        changed = decision.targets != self.last_targets
        if previous is None or decision.fail_safe != previous.fail_safe:
            if decision.fail_safe:
                self.log.warning("fail_safe_entered", reasons=_first_reasons(decision))
                self._event("fail_safe_entered")
            elif previous is not None:
                self.log.info("fail_safe_left", control_level=decision.level)
                self._event("fail_safe_left", level=decision.level)
        if previous is not None and decision.level != previous.level:
            self.log.info("level_changed", old=previous.level, new=decision.level)
        self.last_targets = decision.targets
        result = None
        if not self.settings.agent.observe_only:
            result = await self._actuate(decision)
        if changed or (
            result is not None and any(o.action != "unchanged" for o in result.outcomes)
        ):
            if self.bus is not None:
                self.bus.publish_nowait(self._state_message())
            self.notifier.status(self._status_line())
        return result

    async def _actuate(self, decision: Decision) -> ApplyResult | None:
        actuator = self.actuator
        assert actuator is not None  # noqa: S101 - set in _startup
        samples = {i: s for i, s in self.fresh.items() if i not in self.lost}
        if not actuator.pending(decision.targets, baseline=self.baseline, samples=samples):
            return None
        result = await self.gpu.run(
            partial(actuator.apply, decision.targets, baseline=self.baseline, samples=samples)
        )
        self.fresh.clear()
        self.wrote = True
        targets = {t.index: t for t in decision.targets}
        now = asyncio.get_running_loop().time()
        changed: list[dict[str, Any]] = []
        for outcome in result.outcomes:
            target = targets[outcome.index]
            if outcome.action in ("applied", "reasserted"):
                self.last_outcome_errors.pop(outcome.index, None)
                self.log.info(
                    "cap_reasserted" if outcome.action == "reasserted" else "cap_applied",
                    gpu=outcome.index,
                    changes=list(outcome.changes),
                    sm_clock_max_mhz=target.sm_clock_max_mhz,
                    power_limit_mw=target.power_limit_mw,
                    enforced_power_limit_mw=outcome.enforced_power_limit_mw,
                    reasons=list(target.reasons),
                    policy=self.policy.revision,
                )
                changed.append(
                    {
                        "gpu": outcome.index,
                        "uuid": outcome.uuid,
                        "action": outcome.action,
                        "changes": list(outcome.changes),
                        "reasons": list(target.reasons),
                    }
                )
            elif outcome.action == "lost":
                self._mark_lost(outcome.index, outcome.error or "lost", now)
            elif outcome.action == "failed":
                if self.last_outcome_errors.get(outcome.index) != outcome.error:
                    self.log.error("cap_failed", gpu=outcome.index, error=outcome.error)
                    self._event("cap_failed", gpu=outcome.index, error=outcome.error)
                self.last_outcome_errors[outcome.index] = outcome.error or "failed"
        if changed:
            # One event per decision applied, listing every GPU that changed.
            reasserted = any(c["action"] == "reasserted" for c in changed)
            self._event(
                "cap_reasserted" if reasserted else "cap_changed",
                level=decision.level,
                fail_safe=decision.fail_safe,
                policy_revision=self.policy.revision,
                gpus=changed,
            )
        return result

    async def _publisher(self) -> None:
        interval = self.settings.agent.publish_interval_s
        loop = asyncio.get_running_loop()
        next_t = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, next_t - loop.time()))
            next_t = max(next_t + interval, loop.time())
            try:
                self.publish_telemetry()
            except ValueError as exc:  # pydantic's ValidationError: readings out of bounds
                self.drops.drop("telemetry_invalid", topic="telemetry", detail=str(exc))

    def publish_telemetry(self) -> Telemetry:
        """Build and queue one telemetry message from the samples since the last one."""
        assert self.window is not None  # noqa: S101 - set in _startup
        classes = {t.index: t.priority_class for t in self.last_targets}
        locks = {}
        if self.actuator is not None:
            for index, setting in self.actuator.applied.items():
                locks[index] = setting.sm_clocks_mhz[1] if setting.sm_clocks_mhz else None
        records, power_w, energy_j = self.window.drain(
            classes=classes, lost=set(self.lost), locks=locks
        )
        bus_stats = self.bus.stats if self.bus is not None else None
        gpu_stats = self.gpu.stats()
        decision = self.decision
        message = Telemetry(
            ts_ns=self.clock_ns(),
            seq=self.counters.next_seq(),
            node=self.addr.node,
            interval_s=self.settings.agent.publish_interval_s,
            node_gpu_power_w=power_w,
            node_energy_delta_j=energy_j,
            level=decision.level if decision else 0,
            fail_safe=decision.fail_safe if decision else False,
            gpus=tuple(records),
            health=AgentHealth(
                ticks=self.counters.ticks,
                tick_p99_ms=self.counters.tick_p99_ms(),
                gpu_call_p99_ms=round(gpu_stats["latency_p99_s"] * 1000, 3)
                if gpu_stats.get("latency_p99_s") is not None
                else None,
                outbox_dropped=bus_stats.outbox_dropped if bus_stats else 0,
                inbox_dropped=bus_stats.inbox_dropped if bus_stats else 0,
                control_rejected=self.drops.total,
                reconnects=max(0, bus_stats.connects - 1) if bus_stats else 0,
                clock_skew_s=self._skew_s(),
            ),
        )
        if self.bus is not None:
            self.bus.publish_nowait(
                OutMessage(self.topics.node(self.addr, "telemetry"), encode(message), qos=0)
            )
        return message

    async def _listener(self) -> None:
        assert self.bus is not None  # noqa: S101 - set before the loops start
        while True:
            message = await self.bus.get()
            self.handle_message(message)

    def handle_message(self, message: InMessage) -> None:
        """Act on one received message; count and drop a bad one. Never raises.

        Each message is handled on its own: one that fails validation is counted by reason
        (``SchemaError.reason``) and dropped, and one that trips an unexpected error is
        counted as ``internal`` and logged with its traceback, so no payload, retained or
        not, can end the listener or the agent.
        """
        try:
            self._dispatch(message)
        except SchemaError as exc:
            self.drops.drop(exc.reason, topic=message.topic, detail=str(exc))
        except Exception as exc:
            self.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))

    def _dispatch(self, message: InMessage) -> None:
        t = self.settings.topics
        if message.topic in (
            self.topics.row_control(t.site, t.row),
            self.topics.rack_control(t.site, t.row, t.rack),
        ):
            if message.payload:  # an empty retained payload clears it: nothing to follow
                self._on_control(decode(message.payload, Control), message)
        elif message.topic == self.topics.policy(t.site, t.row):
            if message.payload:  # retained policy cleared: keep what is in force
                self._on_policy_bundle(decode(message.payload, PolicyBundle), message.topic)
        elif message.topic == self.topics.node(self.addr, "assign"):
            if not message.payload:
                self.runtime_classes = {}  # retained assignment cleared
                self._wake.set()
                return
            self._on_assignment(decode(message.payload, Assignment), message.topic)
        else:
            self.drops.drop("topic", topic=message.topic, detail="not a topic the agent reads")

    def _on_control(self, control: Control, message: InMessage) -> None:
        now_mono = message.received_mono_ns or self.mono_ns()
        before = self.tracker.current(now_mono)
        verdict = self.tracker.offer(
            control,
            received_mono_ns=now_mono,
            received_wall_ns=message.received_ns,
            retained=message.retain,
            max_lease_ns=int(self.policy.policy.fail_safe.max_lease_s * 1e9),
        )
        if verdict in REFUSED:
            self.drops.drop(
                f"control_{verdict}",
                topic=message.topic,
                detail=f"control from {control.issuer} seq {control.seq} level {control.level}",
            )
            self.log.debug(
                "control_ignored",
                verdict=verdict,
                scope=control.scope,
                seq=control.seq,
                issuer=control.issuer,
                retained=message.retain,
            )
            return
        # Lease renewals at an unchanged level are routine: debug only.
        routine = before is not None and before.control.level == control.level
        (self.log.debug if routine else self.log.info)(
            "control_accepted" if verdict == "accepted" else "control_observed",
            scope=control.scope,
            control_level=control.level,
            seq=control.seq,
            issuer=control.issuer,
            retained=message.retain,
        )
        self._check_clock_skew()
        self._wake.set()

    def _check_clock_skew(self) -> None:
        """Say so when this node's clock and its controller's disagree beyond the tolerance."""
        skew_ns = self.tracker.skew_ns
        skewed = skew_ns is not None and self.clock_window.skewed(skew_ns, 0)
        if skewed == self.clock_skewed:
            return
        self.clock_skewed = skewed
        skew_s = None if skew_ns is None else round(skew_ns / 1e9, 3)
        if skewed:
            self.log.warning(
                "clock_skew_detected",
                skew_s=skew_s,
                tolerance_s=self.settings.agent.clock_skew_tolerance_s,
                hint="this node's clock and its controller's disagree; check NTP on both. "
                "Control is still followed: leases run on the monotonic clock.",
            )
            self._event("clock_skew_detected", skew_s=skew_s)
        else:
            self.log.info("clock_skew_cleared", skew_s=skew_s)
            self._event("clock_skew_cleared", skew_s=skew_s)
        if self.bus is not None:
            self.bus.publish_nowait(self._status_message("online"))
        self.notifier.status(self._status_line())

    @property
    def remote_policy_path(self) -> Path:
        """The last good policy received from the aggregator."""
        return self.settings.agent.state_dir / REMOTE_POLICY_FILE

    def _on_policy_bundle(self, bundle: PolicyBundle, topic: str) -> None:
        """Validate and apply the aggregator's policy; keep it as the local last good copy."""
        if revision_of(bundle.text.encode("utf-8")) != bundle.revision:
            msg = f"policy bundle revision {bundle.revision} is not the digest of its text"
            raise SchemaError(msg)
        current = self.policy_store.current
        if current is not None and current.revision == bundle.revision and self.remote_policy:
            return
        result = self.policy_store.replace(bundle.text, source=f"mqtt:{topic}")
        if result.errors:
            self.log.error(
                "policy_rejected",
                trigger="mqtt",
                problems=list(result.errors),
                revision=bundle.revision,
                revision_in_force=self.policy.revision,
            )
            self._event(
                "policy_rejected",
                problems=list(result.errors)[:20],
                revision=bundle.revision,
                revision_in_force=self.policy.revision,
            )
            return
        if not self.remote_policy:
            self.log.info("policy_remote_adopted", revision=bundle.revision, topic=topic)
        self.remote_policy = True
        try:
            self.remote_policy_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.remote_policy_path.with_suffix(".tmp")
            tmp.write_text(bundle.text, encoding="utf-8")
            tmp.replace(self.remote_policy_path)
        except OSError as exc:
            self.log.warning(
                "policy_copy_not_saved", path=str(self.remote_policy_path), error=str(exc)
            )
        if result.changed:
            self.log.info(
                "policy_reloaded",
                trigger="mqtt",
                revision=self.policy.revision,
                policy=self.policy.policy.name,
            )
            self._event("policy_applied", revision=self.policy.revision, source="mqtt")
            if self.bus is not None:
                self.bus.publish_nowait(self._status_message("online"))
            self._wake.set()

    def _on_assignment(self, assignment: Assignment, topic: str) -> None:
        declared = set(self.policy.policy.classes)
        unknown = sorted(set(assignment.classes.values()) - declared)
        if unknown:
            self.drops.drop(
                "unknown_class",
                topic=topic,
                detail=f"unknown priority classes {unknown[:8]}; policy declares "
                f"{sorted(declared)}",
            )
            return
        self.runtime_classes = dict(assignment.classes)
        self.log.info("priority_assigned", classes=self.runtime_classes)
        self._wake.set()

    async def _policy_watcher(self) -> None:
        await aiokit.watch_file(
            self.settings.agent.policy_file,
            debounce_s=self.settings.agent.policy_reload_debounce_s,
            action=lambda: self.reload_policy(trigger="file_changed"),
        )

    async def _sighup(self) -> None:
        await aiokit.repeat_on(self.reload_requested, lambda: self.reload_policy(trigger="sighup"))

    def reload_policy(self, *, trigger: str) -> bool:
        """Reload the policy file; keep the last good policy when the new one is invalid."""
        if self.remote_policy:
            self.log.warning(
                "policy_file_ignored",
                trigger=trigger,
                reason="the aggregator's policy is in force",
                revision=self.policy.revision,
            )
            return False
        self.notifier.reloading()
        result = self.policy_store.reload()
        try:
            if result.errors:
                self.log.error(
                    "policy_rejected",
                    trigger=trigger,
                    path=str(self.settings.agent.policy_file),
                    problems=list(result.errors),
                    revision_in_force=self.policy.revision,
                )
                self._event(
                    "policy_rejected",
                    problems=list(result.errors)[:20],
                    revision_in_force=self.policy.revision,
                )
                return False
            if result.changed:
                self.log.info(
                    "policy_reloaded",
                    trigger=trigger,
                    revision=self.policy.revision,
                    policy=self.policy.policy.name,
                )
                self._event("policy_applied", revision=self.policy.revision)
                if self.bus is not None:
                    self.bus.publish_nowait(self._status_message("online"))
                self._wake.set()
            else:
                self.log.info("policy_unchanged", trigger=trigger, revision=self.policy.revision)
            return result.changed
        finally:
            self.notifier.ready(self._status_line())

    async def _watchdog(self) -> None:
        await aiokit.feed_watchdog(self.notifier, self.gate)


def _first_reasons(decision: Decision) -> list[str]:
    return list(decision.targets[0].reasons) if decision.targets else []


def is_fatal(exc: BaseException) -> bool:
    """Whether an error should stop the agent with a message rather than a traceback."""
    return isinstance(exc, FatalError | PolicyError) and not isinstance(exc, GpuLostError)


__all__ = ["Agent", "GpuError", "is_fatal"]
