"""The cooling topology settings: defaults, validation, and the check against the rows."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from polca.cooling.loops import (
    AlarmTiming,
    CoolingSettings,
    Derating,
    ForcedLevels,
    Hysteresis,
    LoopSpec,
)

MINIMAL = """
stale_after_s: 3
loops:
  - name: loopA
    cdu: cdu-a1
    racks: [r1, r2]
    heat_capacity_kw: 600
    design_flow_lpm: 900
  - name: loopB
    cdu: cdu-b1
    racks: [r3]
    heat_capacity_kw: 300
    design_flow_lpm: 450
    supply_setpoint_c: 40
    supply_warning_c: 44
    supply_critical_c: 47
    timing: {escalation_ceiling: critical}
"""


def loop(**overrides: Any) -> dict[str, Any]:
    """The fields of a valid loop, with overrides."""
    return {
        "name": "loopA",
        "cdu": "cduA",
        "racks": ["r1", "r2"],
        "heat_capacity_kw": 100.0,
        "design_flow_lpm": 150.0,
        **overrides,
    }


def test_yaml_topology_loads_with_documented_defaults() -> None:
    """Only name, cdu, racks and the two ratings are required; the rest has defaults."""
    cfg = CoolingSettings.model_validate(yaml.safe_load(MINIMAL))
    a, b = cfg.loops
    assert cfg.stale_after_s == 3
    assert (a.supply_setpoint_c, a.supply_warning_c, a.supply_critical_c) == (30, 35, 40)
    assert (a.pump_count, a.pumps_required, a.capture_fraction) == (2, 1, 0.8)
    assert a.timing == AlarmTiming()
    assert a.derate_start_c == 35.0
    assert a.min_load_kw == pytest.approx(60.0)
    assert a.redundant
    assert b.timing.escalation_ceiling == "critical"
    assert b.timing.raise_after_s == 10.0
    assert cfg.forced == ForcedLevels(warning_level=0, degraded_level=2, critical_level=None)
    assert cfg.loop_of("r3") == "loopB"
    assert cfg.loop_of("r9") is None
    assert CoolingSettings().loops == ()


@pytest.mark.parametrize(
    "model",
    [CoolingSettings, LoopSpec, AlarmTiming, Hysteresis, Derating, ForcedLevels],
)
def test_every_setting_is_documented(model: type[BaseModel]) -> None:
    """Each field carries a description (the configuration reference is generated)."""
    undocumented = [name for name, f in model.model_fields.items() if not f.description]
    assert undocumented == []


def test_models_are_frozen_and_refuse_unknown_keys() -> None:
    """A typo is an error, not a silently ignored key; settings cannot change in place."""
    with pytest.raises(ValidationError, match="supply_warning"):
        LoopSpec.model_validate(loop(supply_warning=30))
    with pytest.raises(ValidationError, match="raise_after"):
        AlarmTiming.model_validate({"raise_after": 3})
    spec = LoopSpec.model_validate(loop())
    with pytest.raises(ValidationError, match="frozen"):
        spec.heat_capacity_kw = 1.0  # type: ignore[misc]


def test_a_rack_belongs_to_at_most_one_loop() -> None:
    """The same rack on two loops is refused, naming both loops."""
    with pytest.raises(ValidationError, match="rack r2 is served by two loops: loopA and loopB"):
        CoolingSettings.model_validate(
            {"loops": [loop(), loop(name="loopB", cdu="cduB", racks=["r2", "r3"])]}
        )


@pytest.mark.parametrize(
    ("loops", "message"),
    [
        ([loop(), loop(cdu="cduB", racks=["r3"])], "loop names must be unique"),
        ([loop(), loop(name="loopB", racks=["r3"])], "each CDU drives one loop"),
    ],
)
def test_loop_names_and_cdus_are_unique(loops: list[dict[str, Any]], message: str) -> None:
    """Two loops with one name, or one CDU driving two loops, are refused."""
    with pytest.raises(ValidationError, match=message):
        CoolingSettings.model_validate({"loops": loops})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"racks": ["r1", "r1"]}, "racks listed twice: \\['r1'\\]"),
        ({"racks": []}, "at least 1 item"),
        ({"rack_weights": {"r7": 1.0}}, "rack_weights names racks it does not serve"),
        ({"rack_weights": {"r1": 0.0}}, "rack_weights must be positive"),
        ({"supply_warning_c": 29.0}, "supply_setpoint_c \\(30\\) < supply_warning_c"),
        ({"supply_critical_c": 35.0}, "supply_warning_c \\(35\\) < supply_critical_c"),
        ({"derating": {"supply_derate_start_c": 41.0}}, "supply_derate_start_c \\(41\\)"),
        ({"min_flow_degraded_fraction": 0.9}, "min_flow_critical_fraction <"),
        ({"min_flow_critical_fraction": 0.75}, "min_flow_critical_fraction <"),
        ({"pump_count": 1, "pumps_required": 2}, "pumps_required \\(2\\) exceeds pump_count"),
        ({"capture_fraction": 0.0}, "greater than 0"),
        ({"capture_fraction": 1.2}, "less than or equal to 1"),
        ({"heat_capacity_kw": -5}, "greater than 0"),
        ({"cdu": "cdu a"}, "String should match pattern"),
        ({"timing": {"escalation_ceiling": "fatal"}}, "warning', 'degraded' or 'critical'"),
    ],
)
def test_inconsistent_loops_are_refused(overrides: dict[str, Any], message: str) -> None:
    """Each inconsistency is reported with the values involved."""
    with pytest.raises(ValidationError, match=message):
        LoopSpec.model_validate(loop(**overrides))


def test_forced_levels_never_descend_with_severity() -> None:
    """A degraded level below the warning level (or critical below degraded) is refused."""
    with pytest.raises(ValidationError, match="must not descend"):
        ForcedLevels(warning_level=2, degraded_level=1)
    with pytest.raises(ValidationError, match="must not descend"):
        ForcedLevels(degraded_level=3, critical_level=2)
    assert ForcedLevels(degraded_level=3, critical_level=3).critical_level == 3


def test_racks_are_checked_against_the_rows() -> None:
    """A loop rack must exist in exactly one row (rack names repeat across rows otherwise)."""
    cfg = CoolingSettings.model_validate(yaml.safe_load(MINIMAL))
    cfg.check_racks({"row1": ["r1", "r2"], "row2": ["r3", "r4"]})
    with pytest.raises(ValueError, match="loop loopB serves rack r3, which is in no row"):
        cfg.check_racks({"row1": ["r1", "r2"]})
    with pytest.raises(ValueError, match="a name used in rows \\['row1', 'row2'\\]"):
        cfg.check_racks({"row1": ["r1", "r2", "r3"], "row2": ["r3"]})


def test_no_redundancy_and_explicit_minimum_load() -> None:
    """pump_count == pumps_required is not redundant; min load can be set explicitly."""
    spec = LoopSpec.model_validate(
        loop(pump_count=2, pumps_required=2, heat_balance_min_load_kw=5.0)
    )
    assert not spec.redundant
    assert spec.min_load_kw == 5.0
