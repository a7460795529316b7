"""A GPU that refuses clock locks (MIG mode) is capped by power instead, and no clock
write ever stands before its power limit in a batch."""

from __future__ import annotations

from polca.agent.actuator import Actuator, Setting, desired_setting
from polca.gpu.backend import Capabilities, GpuInfo, LockSmClocks, ResetSmClocks, SetPowerLimit
from polca.policy import GpuTarget

LOCKS = Capabilities(sm_clock_lock=True, power_limit_write=True)
NO_LOCKS = Capabilities(sm_clock_lock=False, power_limit_write=True)


def info(capabilities: Capabilities, **over: object) -> GpuInfo:
    fields: dict[str, object] = {
        "index": 0,
        "uuid": "GPU-0",
        "name": "NVIDIA A100-SXM4-80GB",
        "capabilities": capabilities,
        "power_limit_min_mw": 100_000,
        "power_limit_max_mw": 400_000,
        "power_limit_default_mw": 400_000,
        "sm_clock_max_mhz": 1410,
        "mig_enabled": not capabilities.sm_clock_lock,
    }
    fields.update(over)
    return GpuInfo(**fields)  # type: ignore[arg-type]


def target(clock_mhz: int | None, power_mw: int | None = None) -> GpuTarget:
    return GpuTarget(
        index=0,
        uuid="GPU-0",
        priority_class="low",
        sm_clock_max_mhz=clock_mhz,
        power_limit_mw=power_mw,
        reasons=("level:T2",),
        sm_clock_reason="level:T2" if clock_mhz else None,
        power_limit_reason="level:T2" if power_mw else None,
    )


def test_a_clock_cap_becomes_the_same_fraction_of_the_power_range_under_mig() -> None:
    with_locks = desired_setting(info(LOCKS), target(1110), 400_000)
    assert with_locks.sm_clocks_mhz is not None
    assert with_locks.power_limit_mw == 400_000
    mig = desired_setting(info(NO_LOCKS), target(1110), 400_000)
    assert mig.sm_clocks_mhz is None
    assert mig.power_limit_mw == int(400_000 * 1110 / 1410)
    both = desired_setting(info(NO_LOCKS), target(1110, power_mw=250_000), 400_000)
    assert both.power_limit_mw == 250_000  # the tighter of the two
    floor = desired_setting(info(NO_LOCKS), target(200), 400_000)
    assert floor.power_limit_mw == 100_000  # never below the GPU's minimum limit


def test_no_clock_write_is_planned_for_a_gpu_that_refuses_locks() -> None:
    """After a crash polca assumes unknown locks everywhere (forget_locks): on a MIG GPU
    that must not plan a reset, which the GPU refuses and which would stop the batch
    before its power limit."""
    actuator = Actuator({0: info(NO_LOCKS)})
    actuator.applied[0] = Setting(None, 400_000)
    actuator.forget_locks()
    [plan] = actuator.plan([target(1110)], baseline=None, samples={})
    assert all(not isinstance(w, LockSmClocks | ResetSmClocks) for w in plan.writes)
    assert [type(w) for w in plan.writes] == [SetPowerLimit]
    [restore] = actuator.plan_restore(None)
    assert all(not isinstance(w, LockSmClocks | ResetSmClocks) for w in restore.writes)
    locking = Actuator({0: info(LOCKS)})
    locking.applied[0] = Setting(None, 400_000)
    locking.forget_locks()
    [plan] = locking.plan([target(1110)], baseline=None, samples={})
    assert isinstance(plan.writes[0], LockSmClocks)
