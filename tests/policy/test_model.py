"""Validation rules of the policy model, checked on plain data (no YAML, no files)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from polca.policy import CapSpec, Policy
from polca.policy.model import RULE_ERROR_TYPE, format_loc


def problems_of(data: Any) -> list[tuple[str, str]]:
    """Validate ``data`` expecting failure; return (key path, message) per problem."""
    with pytest.raises(ValidationError) as info:
        Policy.model_validate(data)
    found: list[tuple[str, str]] = []
    for err in info.value.errors():
        if err["type"] == RULE_ERROR_TYPE:
            assert "ctx" in err
            for loc, msg in err["ctx"]["problems"]:
                found.append((format_loc((*err["loc"], *loc)), msg))
        else:
            found.append((format_loc(err["loc"]), err["msg"]))
    return found


def has(found: list[tuple[str, str]], where: str, text: str) -> bool:
    """Whether a problem at ``where`` mentions ``text``."""
    return any(loc == where and text in msg for loc, msg in found)


def test_base_policy_is_valid(policy_data: dict[str, Any]) -> None:
    """The fixture policy validates and keeps its values."""
    policy = Policy.model_validate(policy_data)
    assert [lvl.name for lvl in policy.levels] == ["T1", "T2", "brake"]
    assert policy.levels[1].caps["high"].sm_clock_max_mhz == 1305
    assert policy.top_level == 3
    assert policy.level_name(0) == "nominal"
    assert policy.level_name(2) == "T2"
    assert policy.level_name(9) == "brake"


def test_policy_is_frozen(policy: Policy) -> None:
    """A validated policy cannot be changed in place."""
    with pytest.raises(ValidationError, match="frozen"):
        policy.name = "other"  # type: ignore[misc]


def test_defaults_fill_optional_sections(policy_data: dict[str, Any]) -> None:
    """release, assignment, trend, thermal_guards and on_stop have documented defaults."""
    for key in ("release", "assignment", "trend", "thermal_guards", "on_stop"):
        del policy_data[key]
    policy = Policy.model_validate(policy_data)
    assert policy.release.margin_pct == 5
    assert policy.release.dwell_s == 10
    assert policy.release.one_level_at_a_time is True
    assert policy.trend is None
    assert policy.thermal_guards == ()
    assert policy.on_stop == "restore"
    assert policy.static_class(index=0, uuid="GPU-x") == "low"


def test_static_class_prefers_uuid_then_index_then_default(policy: Policy) -> None:
    """by_uuid beats by_index, which beats default_class."""
    assert policy.static_class(index=5, uuid="GPU-hi") == "high"
    assert policy.static_class(index=0, uuid="GPU-other") == "high"
    assert policy.static_class(index=5, uuid="GPU-other") == "low"


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ({"sm_clock_max_mhz": 1000, "sm_clock_max_pct": 50}, "not both"),
        ({"power_limit_w": 300, "power_limit_pct": 50}, "not both"),
        ({}, "at least one"),
    ],
)
def test_capspec_one_field_per_dimension(spec: dict[str, Any], text: str) -> None:
    """A cap has at most one clock field, at most one power field, and at least one field."""
    with pytest.raises(ValidationError, match=text):
        CapSpec.model_validate(spec)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"sm_clock_max_mhz": 0}, "sm_clock_max_mhz"),
        ({"sm_clock_max_mhz": -5}, "sm_clock_max_mhz"),
        ({"sm_clock_max_pct": 100.5}, "sm_clock_max_pct"),
        ({"power_limit_pct": 0}, "power_limit_pct"),
        ({"power_limit_w": -1}, "power_limit_w"),
        ({"sm_clock_max_mhz": "1275"}, "sm_clock_max_mhz"),
        ({"sm_clock_max_mhz": 1275.5}, "sm_clock_max_mhz"),
        ({"sm_clock_max_mhz": True}, "sm_clock_max_mhz"),
        ({"sm_clock_max_hz": 1}, "sm_clock_max_hz"),
    ],
)
def test_capspec_rejects_bad_values(spec: dict[str, Any], field: str) -> None:
    """Zero, negative, over-100% values, strings, floats for MHz and unknown keys fail."""
    with pytest.raises(ValidationError) as info:
        CapSpec.model_validate(spec)
    assert [err["loc"] for err in info.value.errors()] == [(field,)]


def test_capspec_accepts_int_for_float_fields() -> None:
    """YAML integers are fine where a float is expected."""
    spec = CapSpec.model_validate({"sm_clock_max_pct": 90, "power_limit_w": 300})
    assert spec.clock == ("sm_clock_max_pct", 90)
    assert spec.power == ("power_limit_w", 300)


def test_schema_version_must_be_1(policy_data: dict[str, Any]) -> None:
    """Unknown schema versions are rejected."""
    policy_data["schema_version"] = 2
    assert has(problems_of(policy_data), "schema_version", "1")


def test_threshold_as_string_is_a_type_error(policy_data: dict[str, Any]) -> None:
    """Strict types: "80" is not a number."""
    policy_data["levels"][0]["threshold_pct"] = "80"
    assert has(problems_of(policy_data), "levels[0].threshold_pct", "valid number")


def test_threshold_above_100_is_rejected(policy_data: dict[str, Any]) -> None:
    """A threshold is a share of the budget, at most 100%."""
    policy_data["levels"][2]["threshold_pct"] = 101
    assert has(problems_of(policy_data), "levels[2].threshold_pct", "less than or equal to 100")


def test_unknown_key_is_rejected(policy_data: dict[str, Any]) -> None:
    """extra="forbid" everywhere: a typo is an error, not a silent default."""
    policy_data["release"]["dwell"] = 3
    assert problems_of(policy_data) == [("release.dwell", "Extra inputs are not permitted")]


def test_thresholds_must_ascend(policy_data: dict[str, Any]) -> None:
    """Thresholds out of order fail at the level that breaks the order."""
    policy_data["levels"][1]["threshold_pct"] = 75
    found = problems_of(policy_data)
    assert has(found, "levels[1].threshold_pct", "must ascend strictly")


def test_equal_thresholds_fail(policy_data: dict[str, Any]) -> None:
    """Two levels at the same threshold are not strictly ascending."""
    policy_data["levels"][1]["threshold_pct"] = 80
    assert has(problems_of(policy_data), "levels[1].threshold_pct", "must ascend strictly")


def test_threshold_gap_below_margin_fails(policy_data: dict[str, Any]) -> None:
    """Adjacent thresholds closer than release.margin_pct are an error."""
    policy_data["levels"][1]["threshold_pct"] = 83
    assert has(problems_of(policy_data), "levels[1].threshold_pct", "release.margin_pct")


def test_margin_must_be_below_lowest_threshold(policy_data: dict[str, Any]) -> None:
    """A margin at or above T1 would make T1 impossible to release."""
    policy_data["release"]["margin_pct"] = 80
    policy_data["levels"][1]["threshold_pct"] = 90
    policy_data["levels"][2]["threshold_pct"] = 100
    assert has(problems_of(policy_data), "release.margin_pct", "never releases")


def test_higher_level_must_not_loosen_a_cap(policy_data: dict[str, Any]) -> None:
    """A class's clock cap may not rise with the level."""
    policy_data["levels"][1]["caps"]["low"]["sm_clock_max_mhz"] = 1300
    found = problems_of(policy_data)
    assert has(found, "levels[1].caps.low.sm_clock_max_mhz", "loosens 1275")


def test_higher_level_must_not_drop_a_cap(policy_data: dict[str, Any]) -> None:
    """Leaving a class out of a higher level uncaps it: an error."""
    del policy_data["levels"][1]["caps"]["low"]
    assert has(problems_of(policy_data), "levels[1]", "drops the clock cap of class 'low'")


def test_higher_level_must_not_drop_a_dimension(policy_data: dict[str, Any]) -> None:
    """Swapping a clock cap for a power cap loosens the clock: an error at the class."""
    policy_data["levels"][1]["caps"]["low"] = {"power_limit_w": 300}
    assert has(problems_of(policy_data), "levels[1].caps.low", "drops the clock cap")


def test_units_must_match_across_levels(policy_data: dict[str, Any]) -> None:
    """MHz at one level and % at the next cannot be ordered without hardware: an error."""
    policy_data["levels"][1]["caps"]["low"] = {"sm_clock_max_pct": 50}
    assert has(problems_of(policy_data), "levels[1].caps.low.sm_clock_max_pct", "one unit")


def test_equal_caps_across_levels_are_allowed(policy_data: dict[str, Any]) -> None:
    """Non-increasing, not strictly decreasing: a cap may stay the same."""
    policy_data["levels"][1]["caps"]["low"]["sm_clock_max_mhz"] = 1275
    Policy.model_validate(policy_data)


@pytest.mark.parametrize(
    ("path", "where"),
    [
        (("default_class",), "default_class"),
        (("assignment", "by_index", 3), "assignment.by_index[3]"),
        (("assignment", "by_uuid", "GPU-z"), "assignment.by_uuid.GPU-z"),
    ],
)
def test_undeclared_class_in_values(
    policy_data: dict[str, Any], path: tuple[str | int, ...], where: str
) -> None:
    """Class names used as values must be declared in classes."""
    target: Any = policy_data
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = "batch"
    assert has(problems_of(policy_data), where, "class 'batch' is not declared")


def test_undeclared_class_in_caps(policy_data: dict[str, Any]) -> None:
    """Class names used as cap keys (levels, fail_safe, guards) must be declared."""
    policy_data["levels"][0]["caps"]["batch"] = {"sm_clock_max_mhz": 900}
    policy_data["fail_safe"]["caps"]["batch"] = {"sm_clock_max_mhz": 900}
    policy_data["thermal_guards"][0]["caps_by_class"] = {"batch": {"sm_clock_max_mhz": 900}}
    found = problems_of(policy_data)
    for where in (
        "levels[0].caps.batch",
        "fail_safe.caps.batch",
        "thermal_guards[0].caps_by_class.batch",
    ):
        assert has(found, where, "class 'batch' is not declared"), found


def test_duplicate_names_fail(policy_data: dict[str, Any]) -> None:
    """Level, guard and class names are unique."""
    policy_data["levels"][1]["name"] = "T1"
    policy_data["thermal_guards"][1]["name"] = "gpu_hot"
    policy_data["classes"] = ["high", "low", "high"]
    found = problems_of(policy_data)
    assert has(found, "levels[1].name", "used twice")
    assert has(found, "thermal_guards[1].name", "used twice")
    assert has(found, "classes[2]", "declared twice")


def test_empty_levels_and_classes_fail(policy_data: dict[str, Any]) -> None:
    """A policy needs at least one class and one level."""
    policy_data["classes"] = []
    policy_data["levels"] = []
    found = problems_of(policy_data)
    assert has(found, "classes", "at least one")
    assert has(found, "levels", "at least one")


def test_bad_name_pattern_fails(policy_data: dict[str, Any]) -> None:
    """Names are identifiers: they end up in reasons and telemetry."""
    policy_data["levels"][0]["name"] = "T 1"
    assert has(problems_of(policy_data), "levels[0].name", "pattern")


@pytest.mark.parametrize(
    ("guard", "where", "text"),
    [
        (
            {"gpu_temp_c": 85, "release_gpu_temp_c": 85},
            "thermal_guards[0].release_gpu_temp_c",
            "must be below",
        ),
        ({"mem_temp_c": 90, "release_mem_temp_c": 95}, "thermal_guards[0].release_mem_temp_c", ""),
        ({"gpu_temp_c": 85}, "thermal_guards[0].gpu_temp_c", "needs release_gpu_temp_c"),
        (
            {"gpu_temp_c": 85, "release_gpu_temp_c": 80, "release_mem_temp_c": 80},
            "thermal_guards[0].release_mem_temp_c",
            "without mem_temp_c",
        ),
        ({}, "thermal_guards[0]", "needs gpu_temp_c or mem_temp_c"),
        ({"gpu_temp_c": 200, "release_gpu_temp_c": 80}, "thermal_guards[0].gpu_temp_c", ""),
    ],
)
def test_thermal_guard_rules(
    policy_data: dict[str, Any], guard: dict[str, Any], where: str, text: str
) -> None:
    """Guards need a trigger, a release below it, and temperatures in a sane range."""
    policy_data["thermal_guards"] = [{"name": "g", "caps": {"sm_clock_max_pct": 50}, **guard}]
    assert has(problems_of(policy_data), where, text)


def test_thermal_guard_needs_caps(policy_data: dict[str, Any]) -> None:
    """A guard with no caps at all would do nothing."""
    policy_data["thermal_guards"] = [{"name": "g", "gpu_temp_c": 85, "release_gpu_temp_c": 80}]
    assert has(problems_of(policy_data), "thermal_guards[0]", "needs caps or caps_by_class")


def test_thermal_guard_caps_by_class_override(policy_data: dict[str, Any]) -> None:
    """caps_by_class wins for the classes it names; caps covers the others."""
    policy_data["thermal_guards"][0]["caps_by_class"] = {"high": {"sm_clock_max_pct": 90}}
    guard = Policy.model_validate(policy_data).thermal_guards[0]
    assert guard.caps_for("high") == CapSpec(sm_clock_max_pct=90)
    assert guard.caps_for("low") == CapSpec(sm_clock_max_pct=75)


def test_fail_safe_is_required(policy_data: dict[str, Any]) -> None:
    """The fail-safe must be stated (an empty caps map opts out explicitly)."""
    del policy_data["fail_safe"]
    assert has(problems_of(policy_data), "fail_safe", "Field required")
    policy_data["fail_safe"] = {"caps": {}}
    assert Policy.model_validate(policy_data).fail_safe.caps == {}


def test_on_stop_values(policy_data: dict[str, Any]) -> None:
    """on_stop is restore, keep or fail_safe."""
    for value in ("keep", "fail_safe", "restore"):
        policy_data["on_stop"] = value
        assert Policy.model_validate(policy_data).on_stop == value
    policy_data["on_stop"] = "reset"
    assert has(problems_of(policy_data), "on_stop", "'restore', 'keep' or 'fail_safe'")


def test_format_loc() -> None:
    """Locations render as YAML key paths."""
    assert format_loc(("levels", 1, "caps", "low", "[key]")) == "levels[1].caps.low"
    assert format_loc(()) == ""
