"""Structured mutations of valid MQTT payloads, each with what the decoder must do with it.

The fuzz test (``tests/telemetry/test_wire_fuzz.py``) and the longer fuzz run
(``bench/fuzz_wire.py``) share this engine. It starts from one valid payload of every
wire kind, with every optional field filled so that every field can be hit, and applies
one mutation at a random place in the JSON tree. Each mutation knows whether the result
must be refused (a string where a number belongs, a bool for an integer, a non-finite or
out-of-int64 number, nesting beyond any bound, a lone surrogate, an unknown key, an
over-long string, another schema version) or may go either way (a dropped key, a flipped
byte, a truncation). A payload that must be refused but decodes is *wrongly accepted*; any
exception other than ``SchemaError`` is a *crash*.

This module is test tooling; it imports polca's schema only to build the valid payloads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from polca.telemetry.schema import (
    AgentHealth,
    Assignment,
    Budget,
    BudgetLimit,
    CduTelemetry,
    ClassPower,
    Control,
    CoolantConnector,
    CoolingAlarm,
    CoolingLoopState,
    DomainReport,
    Event,
    FeedReport,
    GpuCaps,
    GpuHealthReport,
    GpuTelemetry,
    LeakDetector,
    LoopAlarm,
    Meter,
    PolicyBundle,
    Pump,
    RackSummary,
    RowBudgetReport,
    RowSummary,
    SiteReport,
    SourceState,
    State,
    Status,
    Telemetry,
    encode,
)

S = 1_000_000_000
T0 = 1_700_000_000 * S
INT64_MAX = 2**63 - 1
FREE_MAPS = frozenset({"detail", "classes", "forced_levels"})
"""JSON objects whose keys are data, not field names (an extra key there is fine)."""

POLICY_TEXT = "schema_version: 1\nname: fuzz\n"


def _gpu(index: int) -> GpuTelemetry:
    return GpuTelemetry(
        index=index,
        uuid=f"GPU-{index:08d}",
        name="NVIDIA H100 80GB HBM3",
        priority_class="low",
        samples=10,
        power_w=512.5,
        power_min_w=400.0,
        power_mean_w=500.0,
        power_max_w=690.0,
        power_avg_w=505.0,
        energy_j=1.5e7,
        energy_delta_j=500.0,
        gpu_temp_c=61.0,
        gpu_temp_max_c=63.0,
        mem_temp_c=70.0,
        sm_clock_mhz=1755,
        mem_clock_mhz=2619,
        gpu_util_pct=97.0,
        mem_util_pct=55.0,
        power_limit_w=700.0,
        enforced_power_limit_w=700.0,
        clock_event_reasons=4,
        clock_events=("sw_power_cap",),
        locked_sm_clock_max_mhz=1500,
        health=GpuHealthReport(
            xid_errors=1,
            last_xid=79,
            ecc_corrected_volatile=3,
            ecc_uncorrected_volatile=0,
            ecc_corrected_aggregate=30,
            ecc_uncorrected_aggregate=1,
            retired_pages_sbe=0,
            retired_pages_dbe=0,
            retired_pages_pending=0,
            remapped_rows_correctable=2,
            remapped_rows_uncorrectable=0,
            row_remap_pending=0,
            row_remap_failure=0,
            pcie_replays=12,
            power_brake_s=0.5,
            hw_thermal_slowdown_s=0.0,
            sw_thermal_slowdown_s=1.25,
        ),
    )


def valid_messages() -> dict[str, BaseModel]:
    """One valid message of every wire kind, every optional field set."""
    revision = "0123456789ab"
    return {
        "telemetry": Telemetry(
            ts_ns=T0,
            seq=7,
            node="node1",
            interval_s=1.0,
            node_gpu_power_w=1000.0,
            node_energy_delta_j=1000.0,
            level=2,
            gpus=(_gpu(0), _gpu(1)),
            health=AgentHealth(
                ticks=10, tick_p99_ms=0.5, gpu_call_p99_ms=0.1, gpu_errors=2, clock_skew_s=0.01
            ),
        ),
        "status": Status(
            ts_ns=T0,
            state="online",
            node="node1",
            agent_version="0.1",
            backend="nvml",
            gpu_count=8,
            shard="row1",
            role="leader",
            term=5,
            leader="agg",
            policy_name="polca-a100",
            policy_revision=revision,
            started_ns=T0 - S,
            reason="ok",
            clock_skew_s=0.5,
        ),
        "state": State(
            ts_ns=T0,
            seq=8,
            node="node1",
            level=2,
            fail_safe=False,
            lease_expires_ns=T0 + 10 * S,
            control_seq=3,
            policy_revision=revision,
            gpus=(
                GpuCaps(
                    index=0,
                    uuid="GPU-00000000",
                    priority_class="low",
                    sm_clock_max_mhz=1110,
                    power_limit_w=300.0,
                    reasons=("level:T2",),
                    error="none",
                ),
            ),
        ),
        "event": Event(
            ts_ns=T0,
            seq=9,
            node="node1",
            event="cap_changed",
            gpu=0,
            uuid="GPU-00000000",
            detail={"level": 2, "gpus": [{"gpu": 0, "changes": ["sm_clock_locked:210-1110"]}]},
        ),
        "control": Control(
            ts_ns=T0,
            scope="rack",
            row="row1",
            rack="rack1",
            issuer="agg",
            term=5,
            epoch_ns=T0 - 60 * S,
            seq=11,
            level=2,
            level_name="T2",
            issued_ns=T0,
            lease_expires_ns=T0 + 10 * S,
            policy_revision=revision,
            reason="power 90% >= T2",
        ),
        "assignment": Assignment(ts_ns=T0, seq=1, classes={"GPU-00000000": "high", "3": "low"}),
        "meter": Meter(
            ts_ns=T0,
            power_w=23_000.0,
            energy_j=1e9,
            sources=1,
            partial=True,
            missing={"pdu-b": "timeout"},
            states={
                "pdu-a": SourceState(
                    equipment="up",
                    on_battery=True,
                    battery_minutes=12.0,
                    load_pct=40.0,
                    input_voltage_v=230.0,
                )
            },
        ),
        "budget": Budget(
            ts_ns=T0,
            row="row1",
            issuer="site-a",
            term=7,
            epoch_ns=T0 - 60 * S,
            seq=3,
            budget_w=18_000.0,
            issued_ns=T0,
            lease_expires_ns=T0 + 30 * S,
            limited_by="ups-a",
            reason="ups-a: capacity 18000 W",
        ),
        "budget_limit": BudgetLimit(
            ts_ns=T0,
            domain="ups-a",
            watts=15_000.0,
            until_ns=T0 + 3600 * S,
            reason="UPS-A battery service",
            by="ops@host",
        ),
        "site_report": SiteReport(
            ts_ns=T0,
            issuer="site-a",
            term=7,
            publishing=True,
            domains=(
                DomainReport(
                    name="ups-a",
                    kind="ups",
                    parent="switchboard-1",
                    rating_w=40_000.0,
                    capacity_w=20_000.0,
                    unlimited_w=20_000.0,
                    budget_w=18_000.0,
                    nominal_w=36_000.0,
                    measured_w=17_000.0,
                    on_battery=True,
                    feeds=(FeedReport(name="B", rating_w=20_000.0, up=False, equipment="down"),),
                    limit_w=15_000.0,
                    limit_until_ns=T0 + 3600 * S,
                    limit_reason="service",
                    limit_by="ops@host",
                ),
            ),
            rows=(
                RowBudgetReport(
                    name="row1",
                    parent="ups-a",
                    rating_w=25_000.0,
                    budget_w=18_000.0,
                    nominal_w=25_000.0,
                    measured_w=17_000.0,
                    limited_by="ups-a",
                    origin="lease",
                    stale=False,
                ),
            ),
            truncated=False,
        ),
        "policy": PolicyBundle(
            ts_ns=T0, name="fuzz", revision=revision, text=POLICY_TEXT, source="test"
        ),
        "row_summary": RowSummary(
            ts_ns=T0,
            row="row1",
            issuer="agg",
            power_w=20_000.0,
            power_source="meter",
            budget_w=25_000.0,
            effective_budget_w=25_000.0,
            level=1,
            level_name="T1",
            thresholds_w=(20_000.0, 22_250.0),
            trend_w_per_s=1.5,
            lease_expires_ns=T0 + 10 * S,
            racks=(
                RackSummary(
                    rack="rack1",
                    power_w=10_000.0,
                    budget_w=12_000.0,
                    thermal_budget_w=15_000.0,
                    level=1,
                    nodes_online=4,
                    nodes_stale=0,
                    nodes_offline=0,
                ),
            ),
            offline_nodes=("node9",),
            stale_nodes=("node8",),
            electrical_budget_w=25_000.0,
            budget_origin="lease",
            budget_limited_by="ups-a",
            leased_budget_w=25_000.0,
            feeds={"A": True, "B": False},
            floor_w=8_000.0,
            power_by_class=(ClassPower(priority_class="high", power_w=12_000.0),),
        ),
        "cdu": CduTelemetry(
            ts_ns=T0,
            cdu="cdu1",
            loop="loop1",
            secondary=CoolantConnector(
                supply_temp_c=30.0,
                return_temp_c=40.0,
                flow_lpm=400.0,
                delta_pressure_kpa=80.0,
                heat_removed_kw=250.0,
            ),
            primary=CoolantConnector(supply_temp_c=20.0, return_temp_c=28.0, flow_lpm=500.0),
            pumps=(Pump(name="p1", state="running", speed_pct=60.0),),
            leak_detectors=(LeakDetector(name="leak0", state="ok"),),
            valve_position_pct=40.0,
        ),
        "cooling_loop": CoolingLoopState(
            ts_ns=T0,
            loop="loop1",
            cdu="cdu1",
            racks=("rack1",),
            heat_load_kw=200.0,
            heat_removed_kw=199.0,
            capacity_kw=300.0,
            headroom_kw=100.0,
            supply_temp_c=30.0,
            return_temp_c=40.0,
            flow_lpm=400.0,
            flow_fraction=1.0,
            thermal_budget_w=250_000.0,
            alarms=(LoopAlarm(alarm="supply_temp", severity="warning"),),
            forced_levels={"rack1": 2},
        ),
        "cooling_alarm": CoolingAlarm(
            ts_ns=T0,
            loop="loop1",
            alarm="supply_temp",
            severity="warning",
            action="raised",
            value=41.0,
            threshold=40.0,
            text="supply 41 C",
        ),
    }


@dataclass(frozen=True, slots=True)
class Mutant:
    """One mutated payload and what the decoder must do with it."""

    kind: str  # the kind of the valid message it came from
    operation: str
    path: str
    payload: bytes
    must_reject: bool


Path = tuple[str | int, ...]


def _paths(value: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    out: list[tuple[Path, Any]] = [(path, value)]
    if isinstance(value, dict):
        for key, item in value.items():
            out.extend(_paths(item, (*path, key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.extend(_paths(item, (*path, i)))
    return out


def _set(root: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    node = root
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return root


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_MARK = "@@MUTANT@@"


def _dump(data: Any, raw: str | None = None) -> bytes:
    """JSON text of ``data``; ``raw`` replaces the marker string (for invalid JSON tokens)."""
    text = json.dumps(data, ensure_ascii=True)
    if raw is not None:
        text = text.replace(json.dumps(_MARK), raw, 1)
    return text.encode()


def _wrong_type(rng: random.Random, value: Any) -> tuple[Any, bool]:
    """A value of another JSON type than ``value``, and whether it must be refused."""
    if _is_number(value):
        return rng.choice([str(value), True, False, [value], {"v": value}]), True
    if isinstance(value, bool):
        return rng.choice([int(value), "true", float(value)]), True
    if isinstance(value, str):
        return rng.choice([1, 1.5, True, [value], {"v": value}]), True
    if isinstance(value, list):
        return rng.choice(["[]", 0, {"v": 1}]), True
    if isinstance(value, dict):
        return rng.choice([[], "{}", 0]), True
    # null: whether another type fits depends on the field (``int | None`` takes 0).
    return rng.choice([0, "x", True]), False


def mutate(rng: random.Random, kind: str, base: BaseModel) -> Mutant:
    """One random mutation of ``base`` (a valid message of ``kind``)."""
    data = json.loads(encode(base))
    path, value = rng.choice(_paths(data))
    in_free_map = any(p in FREE_MAPS for p in path[:-1])
    where = ".".join(str(p) for p in path) or "<root>"
    op = rng.choice(OPERATIONS)
    raw: str | None = None  # an invalid-JSON or out-of-range token to splice in
    must = False
    if op == "type" and path and not in_free_map:
        new, must = _wrong_type(rng, value)
        data = _set(data, path, new)
    elif op in _RAW_TOKENS:
        raw = rng.choice(_RAW_TOKENS[op])
        data = _set(data, path, _MARK)
        if op == "bigint":
            # Integers must fit in int64; a float field takes a large (finite) number.
            must = (
                len(raw) > 4000
                or isinstance(value, bool | str | list | dict)
                or (isinstance(value, int) and not isinstance(value, bool))
            )
        else:
            must = True
    elif op == "long_string":
        data = _set(data, path, "x" * 200_000)
        must = True
    elif op == "unknown_key" and isinstance(value, dict) and not in_free_map:
        if not (path and path[-1] in FREE_MAPS):
            value["zz_unknown_key"] = 1
            must = True
    elif op == "version":
        data["schema_version"] = rng.choice([True, 1.0, "1", 2, 0, -1, None, [1]])
        must = True
    elif op == "drop_key" and isinstance(value, dict) and value:
        del value[rng.choice(sorted(value))]
    elif op == "kind":
        data["kind"] = rng.choice([k for k in KINDS if k != data["kind"]] + ["", "zzz", 1])
    payload = _dump(data, raw)
    if op == "flip" and payload:
        buf = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        payload = bytes(buf)
    elif op == "truncate" and payload:
        payload = payload[: rng.randrange(len(payload))]
    return Mutant(kind, op, where, payload, must)


_RAW_TOKENS: dict[str, tuple[str, ...]] = {
    "nonfinite": ("1e999", "-1e999", "NaN", "Infinity", "-Infinity"),
    "bigint": (str(2**63), str(-(2**63) - 1), "1" + "0" * 30, "9" * 5000),
    "deep": ("[" * 250 + "]" * 250, "[" * 1000 + "]" * 1000, "[" * 50_000 + "]" * 50_000),
    "surrogate": ('"\\ud800"', '"a\\udfffb"', '"\\ud83d"'),
}


OPERATIONS = (
    "type",
    *_RAW_TOKENS,
    "long_string",
    "unknown_key",
    "version",
    "drop_key",
    "kind",
    "flip",
    "truncate",
)
KINDS = tuple(valid_messages())


@dataclass(slots=True)
class FuzzTally:
    """What one fuzz run found."""

    tried: int = 0
    accepted: int = 0
    crashes: int = 0
    wrongly_accepted: int = 0
    examples: list[str] | None = None

    def note(self, text: str) -> None:
        """Keep the first few findings for the report."""
        if self.examples is None:
            self.examples = []
        if len(self.examples) < 20:
            self.examples.append(text)


def check(
    mutant: Mutant, decode: Callable[[bytes], object], schema_error: type[Exception]
) -> tuple[bool, str | None]:
    """Decode one mutant: (accepted, finding or None)."""
    try:
        decode(mutant.payload)
    except schema_error:
        return False, None
    except Exception as exc:
        return False, f"crash {type(exc).__name__}: {mutant.operation} at {mutant.path}"
    if mutant.must_reject:
        return True, f"wrongly accepted: {mutant.kind} {mutant.operation} at {mutant.path}"
    return True, None
