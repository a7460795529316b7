"""The PDU vendor profiles: scales, fallbacks, hostile values and vendor detection (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polca.errors import ConfigError, ReadingRejectedError
from polca.meter.profiles import (
    MAX_ROWS,
    MISSING,
    PROFILES,
    Profile,
    Value,
    decode,
    generic_profile,
    profile_for,
    vendor_of,
)

R2 = "1.3.6.1.4.1.318.1.1.26"
DEVICE_POWER = f"{R2}.4.3.1.5.1"


def apc_phases(
    power: tuple[object, ...], current: tuple[object, ...], voltage: tuple[object, ...]
) -> dict[str, object]:
    """The rPDU2 phase table of device 1, one row per phase."""
    rows: dict[str, object] = {}
    for i, (p, c, v) in enumerate(zip(power, current, voltage, strict=True), start=1):
        rows |= {
            f"{R2}.6.3.1.2.{i}": 1,
            f"{R2}.6.3.1.5.{i}": c,
            f"{R2}.6.3.1.6.{i}": v,
            f"{R2}.6.3.1.7.{i}": p,
        }
    return rows


def read(profile: str, varbinds: Mapping[str, object], **kwargs: float) -> tuple[float, str]:
    """Decode with a built-in profile bound to its default indexes."""
    reading = decode(PROFILES[profile].bind(), varbinds, power_factor=0.95, **kwargs)
    return reading.power_w, reading.detail


RARITAN = "1.3.6.1.4.1.13742.6"
ST4 = "1.3.6.1.4.1.1718.4.1"
EATON = "1.3.6.1.4.1.534.6.6.7.3"
GEIST = "1.3.6.1.4.1.21239.5.2.3"


@pytest.mark.parametrize(
    ("profile", "varbinds", "watts", "detail"),
    [
        ("apc", {DEVICE_POWER: 523}, 5230.0, "device power"),
        (
            "raritan",
            {f"{RARITAN}.5.2.3.1.4.1.1.5": 27163, f"{RARITAN}.3.3.4.1.7.1.1.5": 1},
            2716.3,
            "inlet active power",
        ),
        ("servertech", {f"{ST4}.3.3.1.3.1.1": 3120}, 3120.0, "input cord active power"),
        ("eaton", {f"{EATON}.5.1.4.0.1": 4410}, 4410.0, "input total power"),
        ("vertiv", {f"{GEIST}.1.1.9.1": 3890}, 3890.0, "total real power"),
        (
            "vertiv",
            {f"{GEIST}.1.1.9.1": MISSING, f"{GEIST}.2.1.12.1": 1000, f"{GEIST}.2.1.12.2": 1100},
            2100.0,
            "phase real power (2 phases)",
        ),
        (
            "eaton",  # rows 1-3 are phases; row 4 (a total on some models) is not added
            {f"{EATON}.4.1.4.0.1.{i}": w for i, w in enumerate((100, 200, 300, 600), 1)},
            600.0,
            "input phase power (3 phases)",
        ),
        (
            "servertech",  # lines x phases: 4.52 A x 230.1 V + 4.48 A x 229.8 V
            {
                f"{ST4}.3.3.1.3.1.1": -1,
                f"{ST4}.4.3.1.3.1.1.1": 452,
                f"{ST4}.4.3.1.3.1.1.2": 448,
                f"{ST4}.5.3.1.3.1.1.1": 2301,
                f"{ST4}.5.3.1.3.1.1.2": 2298,
            },
            (4.52 * 230.1 + 4.48 * 229.8) * 0.95,
            "line current x phase voltage x power factor 0.95 (2 lines)",
        ),
        (
            "raritan",  # 12.34 A x 231 V: the digits scale each sensor
            {
                f"{RARITAN}.5.2.3.1.4.1.1.5": -1,
                f"{RARITAN}.3.3.4.1.7.1.1.5": 0,
                f"{RARITAN}.5.2.3.1.4.1.1.1": 1234,
                f"{RARITAN}.3.3.4.1.7.1.1.1": 2,
                f"{RARITAN}.5.2.3.1.4.1.1.4": 231,
                f"{RARITAN}.3.3.4.1.7.1.1.4": 0,
            },
            12.34 * 231 * 0.95,
            "inlet current x inlet voltage x power factor 0.95",
        ),
    ],
)
def test_each_profile_scales_its_values(
    profile: str, varbinds: dict[str, object], watts: float, detail: str
) -> None:
    """Each vendor's values come out in watts with the MIB's scale, and say which was used."""
    power_w, used = read(profile, varbinds)
    assert power_w == pytest.approx(watts)
    assert used == detail


def test_apc_device_power_minus_one_falls_back_to_phase_power() -> None:
    """A switched APC (device power -1) is read from its phases, and says it skipped."""
    varbinds = {DEVICE_POWER: -1} | apc_phases((150, 160, 170), (70, 70, 70), (230, 230, 230))
    reading = decode(PROFILES["apc"].bind(), varbinds, power_factor=0.95)
    assert reading.power_w == pytest.approx(4800.0)
    assert reading.detail == "phase power (3 phases)"
    assert reading.fallbacks == ("device power: -1 (not supported)",)


def test_apc_without_any_power_falls_back_to_current_x_voltage() -> None:
    """With device power and one phase's power -1, current x voltage x pf is used."""
    varbinds = {DEVICE_POWER: -1} | apc_phases((150, -1, 170), (100, 120, 110), (230, 230, 230))
    reading = decode(PROFILES["apc"].bind(), varbinds, power_factor=0.9)
    assert reading.power_w == pytest.approx((10.0 + 12.0 + 11.0) * 230 * 0.9)
    assert reading.detail == "phase current x phase voltage x power factor 0.9 (3 phases)"
    assert reading.fallbacks == (
        "device power: -1 (not supported)",
        "phase power: -1 (not supported): row 2",
    )


def test_apc_phase_table_counts_only_the_configured_device() -> None:
    """In a daisy chain the phase table lists every device's phases: only ours are added."""
    varbinds: dict[str, object] = {
        f"{R2}.4.3.1.5.2": -1,
        f"{R2}.6.3.1.2.1": 1,
        f"{R2}.6.3.1.7.1": 100,
        f"{R2}.6.3.1.2.2": 2,
        f"{R2}.6.3.1.7.2": 250,
    }
    reading = decode(PROFILES["apc"].bind(device=2), varbinds, power_factor=0.95)
    assert reading.power_w == pytest.approx(2500.0)
    assert reading.detail == "phase power (1 phases)"


def test_apc_legacy_uses_phase_rows_and_the_nominal_voltage() -> None:
    """The old rPDU reports load current only: its phase rows (bank 0) x nominal voltage."""
    legacy = "1.3.6.1.4.1.318.1.1.12.2.3.1.1"
    varbinds: dict[str, object] = {}
    for i, (load, bank) in enumerate([(124, 0), (60, 1), (64, 2)], start=1):
        varbinds |= {f"{legacy}.2.{i}": load, f"{legacy}.5.{i}": bank}
    power_w, detail = read("apc_legacy", varbinds, nominal_voltage_v=230.0)
    assert power_w == pytest.approx(12.4 * 230 * 0.95)
    assert detail == "phase current x nominal voltage 230 V x power factor 0.95 (1 phases)"


def test_every_value_unsupported_is_rejected_as_unsupported() -> None:
    """A device answering -1 for everything gives no reading (reason ``unsupported``)."""
    varbinds = {DEVICE_POWER: -1} | apc_phases((-1,), (-1,), (230,))
    with pytest.raises(ReadingRejectedError, match="supports none") as caught:
        read("apc", varbinds)
    assert caught.value.reason == "unsupported"


def test_no_value_of_the_profile_on_the_device_is_a_config_error() -> None:
    """A device with none of the profile's OIDs (wrong profile or index) is misconfigured."""
    with pytest.raises(ConfigError, match="has none of profile raritan"):
        read("raritan", {"1.3.6.1.4.1.13742.6.5.2.3.1.4.1.1.5": MISSING})


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("523", "type"),
        (b"\x00", "type"),
        (None, "type"),
        (True, "type"),
        (math.nan, "nan"),
        (math.inf, "nan"),
        (-5, "negative"),
        (2**31 - 1, "absurd"),
        (10**400, "absurd"),
    ],
)
def test_hostile_device_power_is_rejected_not_skipped(raw: object, reason: str) -> None:
    """A present but unusable value rejects the reading; its phases are not used instead."""
    varbinds = {DEVICE_POWER: raw} | apc_phases((150,), (70,), (230,))
    with pytest.raises(ReadingRejectedError) as caught:
        read("apc", varbinds)
    assert caught.value.reason == reason


def test_too_many_rows_are_rejected_as_oversized() -> None:
    """A column longer than ``MAX_ROWS`` is refused, not summed."""
    varbinds: dict[str, object] = {f"{GEIST}.1.1.9.1": -1}
    varbinds |= {f"{GEIST}.2.1.12.{i}": 10 for i in range(1, MAX_ROWS + 2)}
    with pytest.raises(ReadingRejectedError) as caught:
        read("vertiv", varbinds)
    assert caught.value.reason == "oversized"


@pytest.mark.parametrize("digits", [10, -2, 1.5, "1"])
def test_raritan_decimal_digits_out_of_range_are_rejected(digits: object) -> None:
    """Decimal digits are a small whole number or the reading is refused."""
    varbinds = {f"{RARITAN}.5.2.3.1.4.1.1.5": 100, f"{RARITAN}.3.3.4.1.7.1.1.5": digits}
    with pytest.raises(ReadingRejectedError):
        read("raritan", varbinds)


def test_sum_of_current_x_voltage_beyond_the_source_bound_is_absurd() -> None:
    """Each factor within range, their product beyond 2 MW: refused as absurd."""
    varbinds = {f"{GEIST}.1.1.9.1": -1, f"{GEIST}.2.1.12.1": -1}
    varbinds |= {f"{GEIST}.2.1.8.1": 900_000, f"{GEIST}.2.1.4.1": 14_000}
    with pytest.raises(ReadingRejectedError) as caught:
        read("vertiv", varbinds)
    assert caught.value.reason == "absurd"


def test_generic_profile_prefers_power_then_current_x_voltage() -> None:
    """Configured OIDs: power in order, then the first current with the first voltage."""
    profile = generic_profile(
        [
            ("power_w", Value("power_w", "1.2.3.1", 0.1)),
            ("current_a", Value("current_a", "1.2.3.2", 0.001)),
            ("voltage_v", Value("voltage_v", "1.2.3.3")),
            ("voltage_v", Value("voltage_v", "1.2.3.4")),
        ]
    )
    first = decode(profile, {"1.2.3.1": 12345}, power_factor=1.0)
    assert first.power_w == pytest.approx(1234.5)
    assert first.detail == "power_w"
    second = decode(
        profile, {"1.2.3.1": MISSING, "1.2.3.2": 5400, "1.2.3.3": 230}, power_factor=1.0
    )
    assert second.power_w == pytest.approx(5.4 * 230)
    assert second.fallbacks == ("power_w: no such object",)


def test_requests_name_every_oid_once() -> None:
    """A bound profile asks for its scalars by GET and each column (and filter) by walk."""
    gets, walks = PROFILES["apc"].bind(device=3).requests()
    assert gets == (f"{R2}.4.3.1.5.3",)
    assert walks == (f"{R2}.6.3.1.7", f"{R2}.6.3.1.2", f"{R2}.6.3.1.5", f"{R2}.6.3.1.6")
    gets, walks = PROFILES["eaton"].bind().requests()
    assert gets == (f"{EATON}.5.1.4.0.1",)


@pytest.mark.parametrize(
    ("sys_object_id", "vendor"),
    [
        ("1.3.6.1.4.1.318.1.3.4.6", "apc"),
        (".1.3.6.1.4.1.13742.6", "raritan"),
        ("1.3.6.1.4.1.1718.4", "servertech"),
        ("1.3.6.1.4.1.534.6.6.7", "eaton"),
        ("1.3.6.1.4.1.21239.5.2", "vertiv"),
        ("1.3.6.1.4.1.99999.1", None),
        ("1.3.6.1.4.1", None),
        ("1.3.6.1.2.1.318", None),
        ("1.3.6.1.2.1.33", "ups"),  # upsMIB itself: an RFC 1628 agent of no vendor MIB
        (".1.3.6.1.2.1.33.1", "ups"),
        ("1.3.6.1.2.1.3", None),
        ("not.an.oid", None),
        (318, None),
    ],
)
def test_vendor_from_sys_object_id(sys_object_id: object, vendor: str | None) -> None:
    """The enterprise number after 1.3.6.1.4.1 names the vendor."""
    assert vendor_of(sys_object_id) == vendor


UPS_OUT = "1.3.6.1.2.1.33.1.4.4.1"


def test_the_ups_profile_sums_its_output_lines() -> None:
    """UPS-MIB: upsOutputPower summed over the lines, else current (tenths of A) x voltage
    per line; the UPS's output, whatever its vendor."""
    lines = {f"{UPS_OUT}.4.{i}": w for i, w in enumerate((4000, 4100, 3900), 1)}
    assert read("ups", lines) == (12_000.0, "output power (3 lines)")
    cxv = {
        f"{UPS_OUT}.3.1": 100,
        f"{UPS_OUT}.2.1": 230,
        f"{UPS_OUT}.3.2": 50,
        f"{UPS_OUT}.2.2": 230,
    }
    watts, detail = read("ups", cxv)
    assert watts == pytest.approx(15.0 * 230 * 0.95)
    assert detail == "output current x output voltage x power factor 0.95 (2 lines)"


def test_unknown_vendor_needs_a_configured_profile() -> None:
    """Auto-detection of an unknown vendor is a configuration error naming the choices."""
    assert profile_for("1.3.6.1.4.1.318.1.3.4.6") is PROFILES["apc"]
    with pytest.raises(ConfigError, match=r"unknown PDU vendor.*generic"):
        profile_for("1.3.6.1.4.1.99999.1")


_ANY_VALUE = st.one_of(
    st.integers(min_value=-2, max_value=10),
    st.integers(),
    st.integers(min_value=2**60, max_value=2**70),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
_GENERIC = generic_profile(
    [
        ("power_w", Value("power", "1.9.1", 0.1)),
        ("current_a", Value("current", "1.9.2", 0.01, column=True)),
        ("voltage_v", Value("voltage", "1.9.3", column=True)),
    ]
)


@st.composite
def _answers(draw: st.DrawFn) -> tuple[Profile, dict[str, object]]:
    """A bound profile and an answer with every GET present and 1-4 rows per column."""
    profile = draw(st.sampled_from([*PROFILES.values(), _GENERIC])).bind()
    gets, walks = profile.requests()
    varbinds: dict[str, object] = {oid: draw(_ANY_VALUE) for oid in gets}
    filters = {v.oid: v.where for v in profile.values() if v.where is not None}
    filter_columns = {where[0] for where in filters.values()}
    for prefix in walks:
        if prefix in filter_columns:
            continue  # set below, for the rows of the column it filters
        for row in draw(st.lists(st.integers(1, 4), min_size=1, max_size=4, unique=True)):
            varbinds[f"{prefix}.{row}"] = draw(_ANY_VALUE)
            if prefix in filters:  # the row passes the filter (a test above covers others)
                column, wanted = filters[prefix]
                varbinds[f"{column}.{row}"] = int(wanted)
    return profile, varbinds


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_answers(), st.floats(0.01, 1.0))
def test_decoding_any_answer_is_a_reading_or_a_rejection(
    answer: tuple[Profile, dict[str, object]], power_factor: float
) -> None:
    """Whatever a device answers, decode returns a sane power or raises ReadingRejectedError."""
    profile, varbinds = answer
    reason = None
    try:
        reading = decode(profile, varbinds, power_factor=power_factor, nominal_voltage_v=230.0)
    except ReadingRejectedError as exc:
        reason = exc.reason
    if reason is not None:
        assert reason in {"type", "nan", "negative", "absurd", "oversized", "unsupported"}
    else:
        assert math.isfinite(reading.power_w)
        assert 0.0 <= reading.power_w <= 2_000_000.0
