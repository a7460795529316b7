"""Property tests of the engine and the ladder over generated policies and GPUs."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from polca.policy import (
    ControlInput,
    EngineState,
    GpuTarget,
    GpuView,
    LadderState,
    Policy,
    decide,
    next_level,
)

NOW_NS = 10**15
CLASSES = ("high", "mid", "low")
GUARD_NAMES = ("g0", "g1", "g2")
UUIDS = tuple(f"GPU-{i}" for i in range(4))
# 2 cores, shared with other suites: no per-example deadline, a modest example count.
PROPS = settings(max_examples=100, deadline=None)

temps_c = st.none() | st.floats(min_value=0, max_value=130, allow_nan=False)


@st.composite
def cap_specs(draw: st.DrawFn) -> dict[str, Any]:
    """Any valid cap spec."""
    clock: dict[str, float] = draw(
        st.sampled_from(
            [
                {},
                {"sm_clock_max_mhz": draw(st.integers(1, 3000))},
                {"sm_clock_max_pct": draw(st.floats(1, 100))},
            ]
        )
    )
    power: dict[str, float] = draw(
        st.sampled_from(
            [
                {},
                {"power_limit_w": draw(st.floats(1, 1000))},
                {"power_limit_pct": draw(st.floats(1, 100))},
            ]
        )
    )
    if not clock and not power:
        clock = {"sm_clock_max_pct": 50.0}
    return {**clock, **power}


@st.composite
def dimension_series(
    draw: st.DrawFn, n_levels: int, unit_choices: list[tuple[str, float]]
) -> list[dict[str, float]]:
    """One dimension of one class across levels: absent up to a level, then non-increasing."""
    choice = draw(st.sampled_from([None, *unit_choices]))
    if choice is None:
        return [{} for _ in range(n_levels)]
    key, top = choice
    start = draw(st.integers(0, n_levels))
    values = sorted((draw(st.floats(1, top)) for _ in range(n_levels - start)), reverse=True)
    if key.endswith("_mhz"):
        values = [float(int(v)) for v in values]
    return [{} for _ in range(start)] + [{key: v} for v in values]


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    """A valid policy: 1-3 classes, 1-4 levels, 0-3 guards, random fail-safe."""
    classes = list(CLASSES[: draw(st.integers(1, 3))])
    n_levels = draw(st.integers(1, 4))
    # Whole numbers keep "gap >= margin" exact (no 4.999999 from float sums).
    margin = draw(st.integers(1, 10))
    thresholds = [draw(st.integers(margin + 1, 60))]
    for _ in range(n_levels - 1):
        thresholds.append(thresholds[-1] + draw(st.integers(margin, margin + 10)))
    if thresholds[-1] > 100:
        thresholds = [margin + 1 + i * margin for i in range(n_levels)]
    level_caps: list[dict[str, dict[str, float]]] = [{} for _ in range(n_levels)]
    for cls in classes:
        clock = draw(
            dimension_series(n_levels, [("sm_clock_max_mhz", 3000.0), ("sm_clock_max_pct", 100.0)])
        )
        power = draw(
            dimension_series(n_levels, [("power_limit_w", 1000.0), ("power_limit_pct", 100.0)])
        )
        for i in range(n_levels):
            spec = {**clock[i], **power[i]}
            if spec:
                level_caps[i][cls] = {
                    k: int(v) if k.endswith("_mhz") else v for k, v in spec.items()
                }
    guards = []
    for name in GUARD_NAMES[: draw(st.integers(0, 3))]:
        guard: dict[str, Any] = {"name": name}
        kinds = draw(st.sampled_from([("gpu",), ("mem",), ("gpu", "mem")]))
        for kind in kinds:
            trigger = draw(st.floats(40, 120))
            guard[f"{kind}_temp_c"] = trigger
            guard[f"release_{kind}_temp_c"] = trigger - draw(st.floats(0.5, 30))
        if draw(st.booleans()):
            guard["caps"] = draw(cap_specs())
        if draw(st.booleans()) or "caps" not in guard:
            guard["caps_by_class"] = {
                cls: draw(cap_specs())
                for cls in draw(st.sets(st.sampled_from(classes), min_size=1))
            }
        guards.append(guard)
    fail_safe = {cls: draw(cap_specs()) for cls in draw(st.sets(st.sampled_from(classes)))}
    data = {
        "schema_version": 1,
        "name": "generated",
        "classes": classes,
        "default_class": draw(st.sampled_from(classes)),
        "assignment": {"by_index": {0: classes[0]}},
        "levels": [
            {"name": f"L{i + 1}", "threshold_pct": thresholds[i], "caps": level_caps[i]}
            for i in range(n_levels)
        ],
        "release": {
            "margin_pct": margin,
            "dwell_s": draw(st.floats(0, 60)),
            "one_level_at_a_time": draw(st.booleans()),
        },
        "trend": draw(st.none() | st.builds(dict, reaction_s=st.floats(0.5, 30))),
        "thermal_guards": guards,
        "fail_safe": {"caps": fail_safe},
    }
    return Policy.model_validate(data)


@st.composite
def gpu_views(draw: st.DrawFn, index: int) -> GpuView:
    """A GPU with random (sometimes unknown) limits, temperatures and class."""
    sm_max = draw(st.none() | st.integers(300, 2500))
    sm_min = draw(st.none() | st.integers(100, sm_max if sm_max is not None else 2500))
    pl_max = draw(st.none() | st.integers(100_000, 1_000_000))
    pl_min = draw(st.none() | st.integers(50_000, pl_max if pl_max is not None else 1_000_000))
    pl_default = draw(st.none() | st.integers(50_000, 1_000_000))
    return GpuView(
        index=index,
        uuid=UUIDS[index],
        priority_class=draw(st.none() | st.sampled_from([*CLASSES, "ghost"])),
        gpu_temp_c=draw(temps_c),
        mem_temp_c=draw(temps_c),
        sm_clock_max_mhz=sm_max,
        sm_clock_min_mhz=sm_min,
        power_limit_min_mw=pl_min,
        power_limit_max_mw=pl_max,
        power_limit_default_mw=pl_default,
    )


@st.composite
def gpu_lists(draw: st.DrawFn) -> list[GpuView]:
    """1-4 GPUs with distinct UUIDs."""
    return [draw(gpu_views(i)) for i in range(draw(st.integers(1, 4)))]


states = st.builds(
    EngineState,
    thermal_latched=st.frozensets(
        st.tuples(st.sampled_from(UUIDS), st.sampled_from(GUARD_NAMES)), max_size=6
    ),
)


def control(level: int) -> ControlInput:
    """A controller at ``level`` with a lease valid for a second."""
    return ControlInput(level=level, lease_expires_ns=NOW_NS + 10**9)


def at_most(a: int | None, b: int | None) -> bool:
    """a <= b where None means no cap (infinity)."""
    return b is None or (a is not None and a <= b)


def tighter_or_equal(a: GpuTarget, b: GpuTarget) -> bool:
    """Every cap of ``a`` is at most the matching cap of ``b``."""
    return at_most(a.sm_clock_max_mhz, b.sm_clock_max_mhz) and at_most(
        a.power_limit_mw, b.power_limit_mw
    )


@PROPS
@given(policy=policies(), gpus=gpu_lists(), state=states, level=st.integers(-2, 6))
def test_caps_within_hardware_limits(
    policy: Policy, gpus: list[GpuView], state: EngineState, level: int
) -> None:
    """Every cap lies within the GPU's known clock and power-limit range."""
    for ctl in (control(level), None):
        decision = decide(gpus, policy=policy, control=ctl, state=state, now_ns=NOW_NS)
        assert len(decision.targets) == len(gpus)
        for gpu, target in zip(gpus, decision.targets, strict=True):
            assert (target.index, target.uuid) == (gpu.index, gpu.uuid)
            assert target.priority_class in policy.classes
            if target.sm_clock_max_mhz is not None:
                assert target.sm_clock_max_mhz > 0
                if gpu.sm_clock_max_mhz is not None:
                    assert target.sm_clock_max_mhz <= gpu.sm_clock_max_mhz
                if gpu.sm_clock_min_mhz is not None:
                    assert target.sm_clock_max_mhz >= gpu.sm_clock_min_mhz
                assert target.sm_clock_reason in target.reasons
            if target.power_limit_mw is not None:
                assert target.power_limit_mw > 0
                if gpu.power_limit_max_mw is not None:
                    assert target.power_limit_mw <= gpu.power_limit_max_mw
                if gpu.power_limit_min_mw is not None:
                    assert target.power_limit_mw >= gpu.power_limit_min_mw
                assert target.power_limit_reason in target.reasons


@PROPS
@given(
    policy=policies(),
    gpus=gpu_lists(),
    state=states,
    levels=st.lists(st.integers(0, 5), min_size=2, max_size=2),
)
def test_monotone_in_level(
    policy: Policy, gpus: list[GpuView], state: EngineState, levels: list[int]
) -> None:
    """A higher level never loosens any GPU's cap."""
    low, high = sorted(levels)
    lower = decide(gpus, policy=policy, control=control(low), state=state, now_ns=NOW_NS)
    higher = decide(gpus, policy=policy, control=control(high), state=state, now_ns=NOW_NS)
    assert higher.level >= lower.level
    for a, b in zip(higher.targets, lower.targets, strict=True):
        assert tighter_or_equal(a, b), (a, b)


@PROPS
@given(
    policy=policies(),
    gpus=gpu_lists(),
    state=states,
    level=st.integers(0, 5),
    rise_c=st.tuples(st.floats(0, 50), st.floats(0, 50)),
)
def test_monotone_in_temperature(
    policy: Policy,
    gpus: list[GpuView],
    state: EngineState,
    level: int,
    rise_c: tuple[float, float],
) -> None:
    """For a fixed state, hotter GPUs get caps at most as high, and latch a superset."""
    hotter = [
        dataclasses.replace(
            gpu,
            gpu_temp_c=None if gpu.gpu_temp_c is None else gpu.gpu_temp_c + rise_c[0],
            mem_temp_c=None if gpu.mem_temp_c is None else gpu.mem_temp_c + rise_c[1],
        )
        for gpu in gpus
    ]
    cool = decide(gpus, policy=policy, control=control(level), state=state, now_ns=NOW_NS)
    hot = decide(hotter, policy=policy, control=control(level), state=state, now_ns=NOW_NS)
    assert hot.state.thermal_latched >= cool.state.thermal_latched
    for a, b in zip(hot.targets, cool.targets, strict=True):
        assert tighter_or_equal(a, b), (a, b)


@PROPS
@given(policy=policies(), gpus=gpu_lists(), state=states, level=st.integers(-1, 5))
def test_same_input_same_output(
    policy: Policy, gpus: list[GpuView], state: EngineState, level: int
) -> None:
    """decide is a function of its arguments."""
    first = decide(gpus, policy=policy, control=control(level), state=state, now_ns=NOW_NS)
    again = decide(list(gpus), policy=policy, control=control(level), state=state, now_ns=NOW_NS)
    assert first == again


@PROPS
@given(
    policy=policies(),
    gpus=gpu_lists(),
    state=states,
    level=st.integers(0, 5),
    expired_by_ns=st.integers(0, 10**12),
)
def test_fail_safe_when_lease_expired(
    policy: Policy, gpus: list[GpuView], state: EngineState, level: int, expired_by_ns: int
) -> None:
    """An expired lease gives exactly the no-controller caps, whatever its level."""
    stale = ControlInput(level=level, lease_expires_ns=NOW_NS - expired_by_ns)
    expired = decide(gpus, policy=policy, control=stale, state=state, now_ns=NOW_NS)
    absent = decide(gpus, policy=policy, control=None, state=state, now_ns=NOW_NS)
    assert expired.fail_safe
    assert expired.level == 0
    assert expired.state == absent.state
    for a, b in zip(expired.targets, absent.targets, strict=True):
        assert (a.sm_clock_max_mhz, a.power_limit_mw) == (b.sm_clock_max_mhz, b.power_limit_mw)
        assert not any(r.startswith("level:") for r in a.reasons)
        assert ("fail_safe:lease_expired" in a.reasons) == ("fail_safe:no_controller" in b.reasons)


@PROPS
@given(
    trigger_c=st.floats(50, 110),
    band_c=st.floats(0.5, 20),
    walk_c=st.lists(st.none() | st.floats(20, 130), min_size=1, max_size=30),
)
def test_thermal_hysteresis(trigger_c: float, band_c: float, walk_c: list[float | None]) -> None:
    """Over any temperature walk a guard latches at the trigger and releases below release."""
    policy = Policy.model_validate(
        {
            "schema_version": 1,
            "name": "h",
            "classes": ["only"],
            "default_class": "only",
            "levels": [{"name": "L1", "threshold_pct": 90}],
            "thermal_guards": [
                {
                    "name": "hot",
                    "gpu_temp_c": trigger_c,
                    "release_gpu_temp_c": trigger_c - band_c,
                    "caps": {"sm_clock_max_mhz": 500},
                }
            ],
            "fail_safe": {"caps": {}},
        }
    )
    state, latched = EngineState(), False
    for temp_c in walk_c:
        gpu = GpuView(0, "GPU-0", None, temp_c, None, 1000, 100, None, None, None)
        decision = decide([gpu], policy=policy, control=control(0), state=state, now_ns=NOW_NS)
        state = decision.state
        if temp_c is not None:  # reference model; an unknown reading holds
            latched = temp_c >= trigger_c or (latched and temp_c >= trigger_c - band_c)
        assert (("GPU-0", "hot") in state.thermal_latched) == latched
        assert decision.targets[0].sm_clock_max_mhz == (500 if latched else None)


@PROPS
@given(
    policy=policies(),
    readings=st.lists(
        st.tuples(st.floats(0, 130), st.none() | st.floats(-5000, 5000), st.floats(0, 20)),
        min_size=1,
        max_size=40,
    ),
)
def test_ladder_invariants(
    policy: Policy, readings: list[tuple[float, float | None, float]]
) -> None:
    """The level stays in range, covers every reached threshold, and releases one step at most."""
    budget_w = 1000.0
    state, now_s = LadderState(), 0.0
    for pct, trend, dt_s in readings:
        now_s += dt_s
        new = next_level(
            power_w=pct * budget_w / 100,
            budget_w=budget_w,
            policy=policy,
            state=state,
            now_s=now_s,
            trend_w_per_s=trend,
        )
        reached = sum(1 for lvl in policy.levels if pct >= lvl.threshold_pct)
        assert 0 <= new.level <= policy.top_level
        assert new.level >= reached
        if new.level < state.level and policy.release.one_level_at_a_time:
            assert new.level == state.level - 1
        if new.level < state.level:
            released = policy.levels[state.level - 1]
            assert pct < released.threshold_pct - policy.release.margin_pct
        state = new
