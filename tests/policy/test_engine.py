"""The pure engine: level, fail-safe and thermal caps per GPU, with reasons."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from polca.policy import (
    ControlInput,
    Decision,
    EngineState,
    GpuTarget,
    GpuView,
    Policy,
    decide,
)
from polca.policy.engine import guard_latched

NOW_NS = 1_000_000_000_000
LEASE_NS = NOW_NS + 5_000_000_000


def gpu(index: int, **changes: Any) -> GpuView:
    """An A100-like GPU view: cool, limits known, class from the policy."""
    view = GpuView(
        index=index,
        uuid=f"GPU-{index}",
        priority_class=None,
        gpu_temp_c=50.0,
        mem_temp_c=60.0,
        sm_clock_max_mhz=1410,
        sm_clock_min_mhz=210,
        power_limit_min_mw=100_000,
        power_limit_max_mw=400_000,
        power_limit_default_mw=400_000,
    )
    return dataclasses.replace(view, **changes)


def run(
    policy: Policy,
    gpus: list[GpuView],
    level: int | None,
    *,
    state: EngineState | None = None,
    lease_ns: int = LEASE_NS,
) -> Decision:
    """decide() at NOW_NS with a controller at ``level`` (None: no controller)."""
    control = None if level is None else ControlInput(level=level, lease_expires_ns=lease_ns)
    return decide(gpus, policy=policy, control=control, state=state or EngineState(), now_ns=NOW_NS)


def caps(target: GpuTarget) -> tuple[int | None, int | None]:
    """(clock MHz, power mW) of a target."""
    return (target.sm_clock_max_mhz, target.power_limit_mw)


def test_nominal_level_caps_nothing(policy: Policy) -> None:
    """Level 0 with a valid lease and cool GPUs: no caps, no reasons."""
    decision = run(policy, [gpu(0), gpu(1)], 0)
    assert decision.level == 0
    assert not decision.fail_safe
    for target in decision.targets:
        assert caps(target) == (None, None)
        assert target.reasons == ()
        assert target.sm_clock_reason is None
        assert target.power_limit_reason is None
    assert decision.state == EngineState()


def test_levels_cap_by_class(policy: Policy) -> None:
    """T1 caps only low; T2 caps low and high; the brake caps both (POLCA's numbers)."""
    gpus = [gpu(0), gpu(1)]  # 0 is high by index, 1 is low by default
    t1 = run(policy, gpus, 1)
    assert [caps(t) for t in t1.targets] == [(None, None), (1275, None)]
    assert t1.targets[0].reasons == ()
    assert t1.targets[1].reasons == ("level:T1",)
    assert t1.targets[1].sm_clock_reason == "level:T1"
    t2 = run(policy, gpus, 2)
    assert [caps(t) for t in t2.targets] == [(1305, None), (1110, None)]
    assert [t.priority_class for t in t2.targets] == ["high", "low"]
    brake = run(policy, gpus, 3)
    assert [caps(t) for t in brake.targets] == [(288, None), (288, None)]
    assert brake.level == 3


@pytest.mark.parametrize(("level", "in_force"), [(99, 3), (4, 3), (-1, 0), (-50, 0)])
def test_out_of_range_level_is_clamped(policy: Policy, level: int, in_force: int) -> None:
    """Levels above the top become the top; below zero become nominal."""
    assert run(policy, [gpu(1)], level).level == in_force


def test_no_controller_applies_fail_safe(policy: Policy) -> None:
    """Without a controller the fail-safe caps apply, level 0."""
    decision = run(policy, [gpu(0), gpu(1)], None)
    assert decision.fail_safe
    assert decision.level == 0
    assert [caps(t) for t in decision.targets] == [(1305, None), (1110, None)]
    assert decision.targets[1].reasons == ("fail_safe:no_controller",)
    assert decision.targets[1].sm_clock_reason == "fail_safe:no_controller"


@pytest.mark.parametrize("lease_ns", [NOW_NS, NOW_NS - 1])
def test_expired_lease_applies_fail_safe(policy: Policy, lease_ns: int) -> None:
    """A lease expiring at or before now is void, whatever level it carried."""
    decision = run(policy, [gpu(1)], 3, lease_ns=lease_ns)
    assert decision.fail_safe
    assert decision.level == 0
    assert caps(decision.targets[0]) == (1110, None)
    assert decision.targets[0].reasons == ("fail_safe:lease_expired",)


def test_lease_valid_one_ns_before_expiry(policy: Policy) -> None:
    """A lease expiring after now is honoured."""
    decision = run(policy, [gpu(1)], 3, lease_ns=NOW_NS + 1)
    assert not decision.fail_safe
    assert caps(decision.targets[0]) == (288, None)


def test_fail_safe_without_caps_for_class(policy_data: dict[str, Any]) -> None:
    """A class the fail-safe does not list stays uncapped."""
    policy_data["fail_safe"] = {"caps": {"low": {"sm_clock_max_mhz": 1110}}}
    decision = run(Policy.model_validate(policy_data), [gpu(0)], None)
    assert decision.fail_safe
    assert caps(decision.targets[0]) == (None, None)
    assert decision.targets[0].reasons == ()


def test_class_resolution_order(policy: Policy) -> None:
    """Runtime class beats by_uuid, which beats by_index, which beats the default."""
    gpus = [
        gpu(0, priority_class="low"),  # runtime overrides by_index high
        gpu(5, uuid="GPU-hi"),  # by_uuid
        gpu(0),  # by_index
        gpu(6),  # default
    ]
    decision = run(policy, gpus, 1)
    assert [t.priority_class for t in decision.targets] == ["low", "high", "high", "low"]


def test_unknown_runtime_class_falls_back(policy: Policy) -> None:
    """A runtime class the policy does not declare is reported and ignored."""
    decision = run(policy, [gpu(0, priority_class="batch")], 2)
    target = decision.targets[0]
    assert target.priority_class == "high"
    assert target.reasons == ("level:T2", "unknown_class:batch")


def test_percent_caps_resolve_against_hardware(policy_data: dict[str, Any]) -> None:
    """% clock caps use the GPU's max SM clock, % power caps its default limit, rounded down."""
    policy_data["levels"][0]["caps"]["low"] = {"sm_clock_max_pct": 90, "power_limit_pct": 75}
    policy_data["levels"][1]["caps"]["low"] = {"sm_clock_max_pct": 79, "power_limit_pct": 75}
    policy_data["levels"][2]["caps"]["low"] = {"sm_clock_max_pct": 20, "power_limit_pct": 50}
    policy = Policy.model_validate(policy_data)
    h100 = gpu(1, sm_clock_max_mhz=1980, power_limit_default_mw=700_000, power_limit_max_mw=700_000)
    targets = [run(policy, [h100], level).targets[0] for level in (1, 2, 3)]
    assert [caps(t) for t in targets] == [(1782, 525_000), (1564, 525_000), (396, 350_000)]
    assert targets[0].power_limit_reason == "level:T1"


def test_unresolvable_percent_caps_are_skipped_with_reason(policy_data: dict[str, Any]) -> None:
    """Without the hardware maximum a % cap cannot resolve: skipped, and said so."""
    policy_data["fail_safe"]["caps"]["low"] = {"sm_clock_max_pct": 80, "power_limit_pct": 80}
    policy = Policy.model_validate(policy_data)
    blind = gpu(1, sm_clock_max_mhz=None, power_limit_default_mw=None)
    target = run(policy, [blind], None).targets[0]
    assert caps(target) == (None, None)
    assert target.reasons == (
        "fail_safe:no_controller",
        "unresolved:fail_safe:no_controller:sm_clock_max_pct",
        "unresolved:fail_safe:no_controller:power_limit_pct",
    )


def test_watts_become_milliwatts_and_are_clamped(policy_data: dict[str, Any]) -> None:
    """power_limit_w converts to mW and is clamped into the GPU's constraints."""
    policy_data["fail_safe"]["caps"]["low"] = {"power_limit_w": 50.5}
    policy_data["fail_safe"]["caps"]["high"] = {"power_limit_w": 900}
    policy = Policy.model_validate(policy_data)
    decision = run(policy, [gpu(1), gpu(0)], None)
    low, high = decision.targets
    assert low.power_limit_mw == 100_000  # raised to the minimum
    assert "clamped:power_limit_min" in low.reasons
    assert high.power_limit_mw == 400_000  # lowered to the maximum, no note
    assert high.reasons == ("fail_safe:no_controller",)
    unknown = run(policy, [gpu(1, power_limit_min_mw=None)], None).targets[0]
    assert unknown.power_limit_mw == 50_500


def test_clock_cap_clamped_to_supported_range(policy: Policy) -> None:
    """The brake's 288 MHz is raised to the GPU's lowest lock clock, with a note."""
    target = run(policy, [gpu(1, sm_clock_min_mhz=345)], 3).targets[0]
    assert target.sm_clock_max_mhz == 345
    assert target.reasons == ("level:brake", "clamped:sm_clock_min")


def test_cap_at_or_above_hardware_max_is_reported(policy: Policy) -> None:
    """A cap above the max is clamped to the max, not dropped (the actuator skips no-ops)."""
    target = run(policy, [gpu(1, sm_clock_max_mhz=1200)], 1).targets[0]
    assert target.sm_clock_max_mhz == 1200
    assert target.reasons == ("level:T1",)


def test_thermal_guard_latches_and_releases(policy: Policy) -> None:
    """gpu_hot latches at 85 C, holds between 80 and 85 C, and releases below 80 C."""
    state = EngineState()
    seen = []
    for temp_c in (84.9, 85.0, 82.0, 80.0, 79.9, 84.0):
        decision = run(policy, [gpu(1, gpu_temp_c=temp_c)], 0, state=state)
        state = decision.state
        seen.append((caps(decision.targets[0]), ("GPU-1", "gpu_hot") in state.thermal_latched))
    latched = ((1057, None), True)  # 75% of 1410 MHz
    free = ((None, None), False)
    assert seen == [free, latched, latched, latched, free, free]


def test_most_restrictive_source_wins(policy: Policy) -> None:
    """Per dimension the lowest cap wins; every active source is listed."""
    hot = gpu(1, gpu_temp_c=90.0, mem_temp_c=95.0)
    t1 = run(policy, [hot], 1).targets[0]
    assert caps(t1) == (1057, 280_000)
    assert t1.reasons == ("level:T1", "thermal:gpu_hot", "thermal:hbm_hot")
    assert t1.sm_clock_reason == "thermal:gpu_hot"
    assert t1.power_limit_reason == "thermal:hbm_hot"
    brake = run(policy, [hot], 3).targets[0]
    assert caps(brake) == (288, 280_000)
    assert brake.sm_clock_reason == "level:brake"


def test_tie_goes_to_the_level(policy_data: dict[str, Any]) -> None:
    """When a guard equals the level's cap, the level is named as the winner."""
    policy_data["thermal_guards"][0]["caps"] = {"sm_clock_max_mhz": 1110}
    policy = Policy.model_validate(policy_data)
    target = run(policy, [gpu(1, gpu_temp_c=90.0)], 2).targets[0]
    assert target.sm_clock_max_mhz == 1110
    assert target.sm_clock_reason == "level:T2"


def test_thermal_caps_by_class(policy_data: dict[str, Any]) -> None:
    """caps_by_class gives a class its own thermal cap."""
    policy_data["thermal_guards"][0]["caps_by_class"] = {"high": {"sm_clock_max_pct": 90}}
    policy = Policy.model_validate(policy_data)
    decision = run(policy, [gpu(0, gpu_temp_c=90.0), gpu(1, gpu_temp_c=90.0)], 0)
    assert [t.sm_clock_max_mhz for t in decision.targets] == [1269, 1057]


def test_missing_temperature_keeps_a_latch(policy: Policy) -> None:
    """A hot GPU whose sensor stops answering stays capped."""
    hot = run(policy, [gpu(1, mem_temp_c=95.0)], 0)
    blind = run(policy, [gpu(1, mem_temp_c=None)], 0, state=hot.state)
    assert blind.targets[0].power_limit_mw == 280_000
    assert blind.state == hot.state


def test_latches_of_absent_gpus_are_kept(policy: Policy) -> None:
    """A GPU missing from one call keeps its latch; unknown guards' latches are dropped."""
    state = EngineState(frozenset({("GPU-7", "gpu_hot"), ("GPU-7", "old_guard")}))
    decision = run(policy, [gpu(1)], 0, state=state)
    assert decision.state.thermal_latched == frozenset({("GPU-7", "gpu_hot")})


def test_guard_on_both_temperatures(policy_data: dict[str, Any]) -> None:
    """A guard on GPU and memory temperature triggers on either, releases when both cool."""
    policy_data["thermal_guards"] = [
        {
            "name": "both",
            "gpu_temp_c": 85,
            "release_gpu_temp_c": 80,
            "mem_temp_c": 90,
            "release_mem_temp_c": 85,
            "caps": {"sm_clock_max_mhz": 900},
        }
    ]
    guard = Policy.model_validate(policy_data).thermal_guards[0]
    assert guard_latched(guard, gpu(1, gpu_temp_c=50.0, mem_temp_c=90.0), was_latched=False)
    assert guard_latched(guard, gpu(1, gpu_temp_c=82.0, mem_temp_c=50.0), was_latched=True)
    assert not guard_latched(guard, gpu(1, gpu_temp_c=79.0, mem_temp_c=84.0), was_latched=True)
    # No memory sensor at all: the GPU temperature alone can release it.
    assert not guard_latched(guard, gpu(1, gpu_temp_c=79.0, mem_temp_c=None), was_latched=True)
    assert guard_latched(guard, gpu(1, gpu_temp_c=None, mem_temp_c=None), was_latched=True)


def test_decide_is_deterministic(policy: Policy) -> None:
    """The same input gives an equal decision."""
    gpus = [gpu(i, gpu_temp_c=70.0 + 3 * i) for i in range(8)]
    assert run(policy, gpus, 2) == run(policy, gpus, 2)


def test_target_order_follows_input(policy: Policy) -> None:
    """Targets come back in the order of the GPU views."""
    gpus = [gpu(3), gpu(1), gpu(2)]
    assert [t.index for t in run(policy, gpus, 1).targets] == [3, 1, 2]
