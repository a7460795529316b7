"""Actuator: clamped, snapped, idempotent writes with read-back and re-assertion.

The actuator only plans writes and records their results; these tests execute the plans
through ``execute_writes`` on the simulated backend, as ``ThreadedGpu.write`` does on the
GPU thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from polca.agent.actuator import Actuator, ApplyResult, GpuPlan, Setting, desired_setting
from polca.agent.baseline import Baseline
from polca.gpu.backend import GpuInfo, GpuSample, LockSmClocks, SetPowerLimit, execute_writes
from polca.gpu.simulated import SimulatedBackend
from polca.policy import GpuTarget


class _Driven:
    """An actuator with the simulated GPUs it writes to."""

    def __init__(self, backend: SimulatedBackend, actuator: Actuator) -> None:
        self.backend = backend
        self.actuator = actuator

    def run(self, plans: Sequence[GpuPlan]) -> ApplyResult:
        results = execute_writes(self.backend, [plan.writes for plan in plans])
        return self.actuator.record(plans, results)

    def apply(
        self,
        targets: Sequence[GpuTarget],
        *,
        baseline: Baseline | None,
        samples: Mapping[int, GpuSample],
    ) -> ApplyResult:
        return self.run(self.actuator.plan(targets, baseline=baseline, samples=samples))

    def pending(self, targets: Sequence[GpuTarget], **kwargs: object) -> bool:
        return self.actuator.pending(self.actuator.plan(targets, **kwargs))  # type: ignore[arg-type]

    def restore(self, baseline: Baseline | None) -> ApplyResult:
        return self.run(self.actuator.plan_restore(baseline))

    def drifted(self, samples: Mapping[int, GpuSample]) -> bool:
        return self.actuator.drifted(samples)

    @property
    def applied(self) -> dict[int, Setting]:
        return self.actuator.applied


def _rig(count: int = 2) -> tuple[SimulatedBackend, _Driven, Sequence[GpuInfo]]:
    backend = SimulatedBackend(
        count=count, model="A100-SXM4", load="constant:0.5", seed=1, clock=lambda: 0.0
    )
    infos = backend.discover()
    actuator = Actuator({i.index: i for i in infos})
    actuator.adopt([backend.sample(i.index) for i in infos])
    return backend, _Driven(backend, actuator), infos


def _target(info: GpuInfo, *, clock: int | None = None, power_mw: int | None = None) -> GpuTarget:
    return GpuTarget(info.index, info.uuid, "low", clock, power_mw, ("test",), None, None)


def test_clock_cap_is_snapped_down_to_a_supported_value() -> None:
    """A cap between supported clocks locks at the next supported value below it."""
    _, _, infos = _rig()
    info = infos[0]
    assert 1275 in info.supported_sm_clocks_mhz
    setting = desired_setting(info, _target(info, clock=1280), None)
    assert setting.sm_clocks_mhz == (min(info.supported_sm_clocks_mhz), 1275)
    at_max = desired_setting(info, _target(info, clock=info.sm_clock_max_mhz), None)
    assert at_max.sm_clocks_mhz is None  # a cap at the hardware maximum is no lock


def test_power_cap_is_clamped_to_constraints() -> None:
    """Limits below the minimum or above the maximum are clamped, never sent as is."""
    _, _, infos = _rig()
    info = infos[0]
    assert info.power_limit_min_mw is not None
    assert info.power_limit_max_mw is not None
    low = desired_setting(info, _target(info, power_mw=1_000), None)
    high = desired_setting(info, _target(info, power_mw=10_000_000), None)
    assert low.power_limit_mw == info.power_limit_min_mw
    assert high.power_limit_mw == info.power_limit_max_mw


def test_apply_writes_once_then_skips_unchanged() -> None:
    """The first apply writes and reads back; the same targets again write nothing."""
    backend, actuator, infos = _rig()
    targets = [_target(info, clock=1110, power_mw=300_000) for info in infos]
    first = actuator.apply(targets, baseline=None, samples={})
    assert [o.action for o in first.outcomes] == ["applied", "applied"]
    assert first.outcomes[0].enforced_power_limit_mw == 300_000
    sample = backend.sample(0)
    assert sample.locked_sm_clocks_mhz is not None
    assert sample.locked_sm_clocks_mhz[1] == 1110
    assert sample.power_limit_mw == 300_000
    assert not actuator.pending(targets, baseline=None, samples={})
    second = actuator.apply(targets, baseline=None, samples={})
    assert [o.action for o in second.outcomes] == ["unchanged", "unchanged"]


def test_limit_changed_by_someone_else_is_reasserted() -> None:
    """A power limit changed outside polca is detected in a fresh sample and re-applied."""
    backend, actuator, infos = _rig()
    targets = [_target(info, power_mw=250_000) for info in infos]
    actuator.apply(targets, baseline=None, samples={})
    backend.external_set_power_limit_mw(1, 400_000)
    fresh = {i.index: backend.sample(i.index) for i in infos}
    assert actuator.drifted(fresh)
    result = actuator.apply(targets, baseline=None, samples=fresh)
    assert result.outcomes[1].action == "reasserted"
    assert result.outcomes[0].action == "unchanged"
    assert backend.sample(1).power_limit_mw == 250_000


def test_no_power_cap_means_the_original_limit() -> None:
    """Without a power cap the baseline's original limit is what the GPU gets back."""
    backend, actuator, infos = _rig()
    baseline = Baseline.capture(infos, [backend.sample(i.index) for i in infos], now_ns=1)
    backend.external_set_power_limit_mw(0, 350_000)  # operator's setting before polca
    baseline = Baseline.capture(infos, [backend.sample(i.index) for i in infos], now_ns=1)
    actuator.actuator.adopt([backend.sample(i.index) for i in infos])
    actuator.apply([_target(infos[0], power_mw=200_000)], baseline=baseline, samples={})
    assert backend.sample(0).power_limit_mw == 200_000
    actuator.apply([_target(infos[0])], baseline=baseline, samples={})
    assert backend.sample(0).power_limit_mw == 350_000


def test_restore_unlocks_and_puts_limits_back() -> None:
    """restore() resets clock locks and the original limits on every GPU."""
    backend, actuator, infos = _rig()
    baseline = Baseline.capture(infos, [backend.sample(i.index) for i in infos], now_ns=1)
    actuator.apply(
        [_target(i, clock=900, power_mw=200_000) for i in infos], baseline=baseline, samples={}
    )
    result = actuator.restore(baseline)
    assert all(o.action == "applied" for o in result.outcomes)
    for info in infos:
        sample = backend.sample(info.index)
        assert sample.locked_sm_clocks_mhz is None
        assert sample.power_limit_mw == info.power_limit_default_mw


def test_lost_and_denied_gpus_are_outcomes_not_exceptions() -> None:
    """One lost GPU and refused writes come back as data; the other GPU is still written."""
    backend, actuator, infos = _rig()
    backend.lose_gpu(0)
    result = actuator.apply([_target(i, clock=1110) for i in infos], baseline=None, samples={})
    assert result.outcomes[0].action == "lost"
    assert result.outcomes[1].action == "applied"
    backend.deny_writes()
    denied = actuator.apply([_target(infos[1], clock=900)], baseline=None, samples={})
    assert denied.outcomes[0].action == "failed"
    assert denied.outcomes[0].error
    assert actuator.applied[1] == Setting((min(infos[1].supported_sm_clocks_mhz), 1110), 400_000)


def test_planning_is_pure_and_names_each_write() -> None:
    """A plan lists typed writes and touches no GPU; only executing it changes the GPU."""
    backend, driven, infos = _rig(count=1)
    before = backend.held(0)
    (plan,) = driven.actuator.plan(
        [_target(infos[0], clock=1110, power_mw=300_000)], baseline=None, samples={}
    )
    low = min(infos[0].supported_sm_clocks_mhz)
    assert plan.writes == (LockSmClocks(0, low, 1110), SetPowerLimit(0, 300_000))
    assert backend.held(0) == before  # planning wrote nothing
    assert driven.applied[0] != Setting((low, 1110), 300_000)  # nor recorded anything
    result = driven.run((plan,))
    assert result.outcomes[0].action == "applied"
    assert backend.held(0) == ((low, 1110), 300_000)
