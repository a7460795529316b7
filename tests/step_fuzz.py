"""In-bounds fuzz of the aggregator's whole step: valid messages with extreme values.

The wire fuzz (``tests/wire_fuzz.py``) proves the decoders refuse what is out of bounds.
This engine does the opposite: every message it makes *passes* the decoder, with each
numeric field drawn towards its wire maximum (or minimum), every list towards its bound
(GPU lists as long as a payload can carry), strings at their longest, free-form event
detail at its widest and deepest. Those messages go through the real aggregator's
``handle_message`` (intake, plausibility, admission, routing to the sinks) and a control
step runs every few messages (rollups, cooling, ladders, the messages and points it
publishes). A step or handler that raises, or an error counted ``internal`` by a
last-resort guard, is a finding.

Values come from each payload's own JSON Schema (``model_json_schema``), so a field added
to the wire is fuzzed without touching this file. Shared by
``tests/aggregator/test_step_fuzz.py`` (a CI budget) and ``bench/fuzz_step.py`` (100,000
messages and more). Test tooling: it builds a real ``Aggregator`` on the in-memory broker.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polca.aggregator.config import AggregatorSettings
from polca.aggregator.runtime import Aggregator
from polca.export.sink import MemorySink
from polca.telemetry.memory import MemoryBroker, MemoryBus
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import (
    MAX_PAYLOAD_BYTES,
    CduTelemetry,
    Control,
    Event,
    Meter,
    State,
    Status,
    Telemetry,
)
from tests.row import FakeClock

SITE, ROW, ROOT_TOPIC = "dc1", "row1", "polca/v1"
RACKS = {"rack1": ["n1", "n2", "n3"], "rack2": ["n4", "n5", "n6"], "rack3": ["n7", "n8"]}
NODES = {node: rack for rack, nodes in RACKS.items() for node in nodes}
CDU = "cdu1"
_NAME_CHARS = string.ascii_letters + string.digits + "_.:-"
_S = 1_000_000_000


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return dict(defs[ref.rsplit("/", 1)[1]])
    return schema


def _number(rng: random.Random, schema: dict[str, Any], *, integer: bool) -> float | int:
    """A number within the schema's bounds, drawn towards them."""
    top = 2**63 - 1 if integer else 1e15
    low = schema.get("minimum", schema.get("exclusiveMinimum", -top))
    high = schema.get("maximum", schema.get("exclusiveMaximum", top))
    excl_low = "exclusiveMinimum" in schema
    excl_high = "exclusiveMaximum" in schema
    choice = rng.random()
    if choice < 0.35:
        value = high
    elif choice < 0.5:
        value = high * rng.choice((0.999999, 0.9, 0.5)) if high > 0 else high
    elif choice < 0.6:
        value = low
    elif choice < 0.7:
        value = 0 if low <= 0 <= high else low
    else:
        value = rng.uniform(low, high) if high - low < 1e300 else rng.uniform(-1e12, 1e12)
    value = min(max(value, low), high)
    if integer:
        value = int(value)
        if excl_low and value <= low:
            value = int(low) + 1
        if excl_high and value >= high:
            value = int(high) - 1
        return min(max(value, int(low)), int(high))
    value = float(value)
    if excl_low and value <= low:
        value = low + max(abs(low) * 1e-9, 1e-9)
    if excl_high and value >= high:
        value = high - max(abs(high) * 1e-9, 1e-9)
    return float(value)


_POOLS = {
    name: "".join(random.Random(name).choice(alphabet) for _ in range(20_000))  # noqa: S311
    for name, alphabet in (
        ("name", _NAME_CHARS),
        ("text", string.printable + "äé€🙂\u2028"),
    )
}
"""Random text to cut strings from (drawing each character costs too much)."""


def _string(rng: random.Random, schema: dict[str, Any]) -> str:
    longest = schema.get("maxLength", 64)
    shortest = schema.get("minLength", 0)
    length = max(
        shortest, rng.choice((shortest, longest, min(longest, 8), rng.randint(shortest, longest)))
    )
    pool = _POOLS["name" if "pattern" in schema else "text"]
    start = rng.randrange(len(pool) - length)
    return pool[start : start + length]


def _json(rng: random.Random, depth: int) -> Any:
    """Free-form JSON (an event's ``detail`` value) up to the depth the wire allows."""
    kind = rng.random()
    if depth >= 7 or kind < 0.4:
        return rng.choice(
            (0, 2**63 - 1, -(2**63) + 1, 1e308, -1e308, True, None, "x" * 4096, '\u2028"\\')
        )
    if kind < 0.7:
        return [_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}": _json(rng, depth + 1) for i in range(rng.randint(0, 4))}


def value(rng: random.Random, schema: dict[str, Any], defs: dict[str, Any]) -> Any:
    """A value of ``schema``, in bounds, with a bias towards the extremes."""
    schema = _resolve(schema, defs)
    if "anyOf" in schema:
        options = [_resolve(o, defs) for o in schema["anyOf"]]
        not_null = [o for o in options if o.get("type") != "null"]
        if not_null and rng.random() < 0.85:
            return value(rng, rng.choice(not_null), defs)
        return None
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return _number(rng, schema, integer=True)
    if kind == "number":
        return _number(rng, schema, integer=False)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return _string(rng, schema)
    if kind == "array":
        items = schema.get("prefixItems") or [schema.get("items", {})]
        longest = min(schema.get("maxItems", 8), 64)
        count = rng.choice((0, 1, longest, rng.randint(0, longest)))
        return [value(rng, items[i % len(items)], defs) for i in range(count)]
    if kind == "object" and "properties" in schema:
        return {
            name: value(rng, prop, defs)
            for name, prop in schema["properties"].items()
            if name in schema.get("required", ()) or rng.random() < 0.9
        }
    if kind == "object":  # a map: an event's detail, forced levels
        longest = min(schema.get("maxProperties", 8), 64)
        keys = schema.get("propertyNames", {"maxLength": 64})
        values = schema.get("additionalProperties", {})
        count = rng.choice((0, longest, rng.randint(0, longest)))
        return {
            _string(rng, keys) or f"k{i}": (
                _json(rng, 1) if not values else value(rng, values, defs)
            )
            for i in range(count)
        }
    return _json(rng, 1)


_SCHEMAS = {
    model: model.model_json_schema()
    for model in (Telemetry, Status, Event, State, Meter, CduTelemetry, Control)
}


def _payload(
    rng: random.Random, model: type[Any], identity: dict[str, Any], *, skip: str = ""
) -> dict[str, Any]:
    """A payload of ``model``; ``skip``: a field the caller fills (not drawn here)."""
    schema = dict(_SCHEMAS[model])
    if skip:
        schema["properties"] = {k: v for k, v in schema["properties"].items() if k != skip}
        schema["required"] = [k for k in schema.get("required", ()) if k != skip]
    data: dict[str, Any] = value(rng, schema, schema.get("$defs", {}))
    data.update(identity)
    return data


def _fit(data: dict[str, Any], key: str) -> bytes:
    """The payload, with the list at ``key`` cut until the whole fits the wire."""
    payload = json.dumps(data).encode()
    items = data.get(key)
    if len(payload) <= MAX_PAYLOAD_BYTES or not isinstance(items, list):
        return payload
    low, high = 0, len(items)
    while low < high:  # the longest prefix that fits
        mid = (low + high + 1) // 2
        data[key] = items[:mid]
        if len(json.dumps(data).encode()) <= MAX_PAYLOAD_BYTES:
            low = mid
        else:
            high = mid - 1
    data[key] = items[:low]
    return json.dumps(data).encode()


def _gpus(rng: random.Random, node: str) -> list[dict[str, Any]]:
    """A GPU list: the node's usual GPUs, or as many as a payload can carry (copies of a
    few extreme GPUs under other indices and UUIDs: drawing each costs too much)."""
    schema = _SCHEMAS[Telemetry]
    gpu_schema = schema["$defs"]["GpuTelemetry"]
    count = rng.choice((0, 1, 4, 8, 8, 8, 16, 1024))
    drawn = [value(rng, gpu_schema, schema["$defs"]) for _ in range(min(count, 8))]
    gpus = []
    for i in range(count):
        gpu = dict(drawn[i % len(drawn)])
        if count <= 16 or rng.random() < 0.5:
            gpu["index"] = i % 1024
        if count <= 16 and rng.random() < 0.8:
            gpu["uuid"] = f"GPU-{node}-{i}"
        elif count > 16:
            gpu["uuid"] = f"GPU-{node}-x{rng.randrange(1 << 30)}"
        gpus.append(gpu)
    return gpus


def message(rng: random.Random, now_ns: int) -> InMessage:
    """One valid message on a topic the aggregator reads, extreme in every field."""
    node = rng.choice(list(NODES))
    base = f"{ROOT_TOPIC}/{SITE}/{ROW}/{NODES[node]}/{node}"
    kind = rng.random()
    ts_ns = rng.choice((now_ns, 0, 2**63 - 1, now_ns + 3600 * _S))
    retain = rng.random() < 0.05
    if kind < 0.5:
        identity = {"node": node, "ts_ns": ts_ns, "kind": "telemetry"}
        data = _payload(rng, Telemetry, identity, skip="gpus")
        data["gpus"] = _gpus(rng, node)
        return InMessage(f"{base}/telemetry", _fit(data, "gpus"), retain, now_ns)
    if kind < 0.6:
        data = _payload(rng, Status, {"node": node, "ts_ns": ts_ns, "kind": "status"})
        return InMessage(f"{base}/status", json.dumps(data).encode(), retain, now_ns)
    if kind < 0.72:
        data = _payload(rng, Event, {"node": node, "ts_ns": ts_ns, "kind": "event"})
        return InMessage(f"{base}/events", _fit(data, "detail"), False, now_ns)
    if kind < 0.76:
        data = _payload(rng, State, {"node": node, "ts_ns": ts_ns, "kind": "state"})
        return InMessage(f"{base}/state", _fit(data, "gpus"), retain, now_ns)
    if kind < 0.78:
        data = _payload(rng, Meter, {"ts_ns": ts_ns, "kind": "meter"})
        return InMessage(
            f"{ROOT_TOPIC}/{SITE}/{ROW}/meter", json.dumps(data).encode(), False, now_ns
        )
    if kind < 0.97:
        data = _payload(rng, CduTelemetry, {"cdu": CDU, "ts_ns": ts_ns, "kind": "cdu"})
        topic = f"{ROOT_TOPIC}/{SITE}/cooling/{CDU}/telemetry"
        return InMessage(topic, json.dumps(data).encode(), False, now_ns)
    rack = rng.choice([None, *RACKS])
    identity = {"row": ROW, "rack": rack, "scope": "rack" if rack else "row", "kind": "control"}
    data = _payload(rng, Control, {**identity, "ts_ns": ts_ns})
    data["issuer"] = rng.choice(("agg", "agg-peer", "stranger"))
    topic = f"{ROOT_TOPIC}/{SITE}/{ROW}/{rack + '/' if rack else ''}control"
    return InMessage(topic, json.dumps(data).encode(), retain, now_ns)


def aggregator(tmp: Path, policy: Path, clock: FakeClock) -> Aggregator:
    """A real aggregator on the in-memory broker: the fuzz's target, started."""
    settings = AggregatorSettings(
        site=SITE,
        instance="agg",
        policy_file=policy,
        state_dir=tmp / "aggregator",
        rows=[
            {
                "name": ROW,
                "budget_w": 150_000.0,
                "racks": [
                    {
                        "name": rack,
                        "budget_w": 40_000.0 if rack == "rack1" else None,
                        "nodes": [{"name": n, "non_gpu_w": 300.0} for n in nodes],
                    }
                    for rack, nodes in RACKS.items()
                ],
            }
        ],
        control={"interval_s": 1.0, "warmup_s": 0.0},
        ha={"peers": ["agg-peer"]},
        cooling={
            "loops": [
                {
                    "name": "loop1",
                    "cdu": CDU,
                    "racks": ["rack2"],
                    "heat_capacity_kw": 40,
                    "design_flow_lpm": 100,
                }
            ]
        },
        # Admission is fuzzed by the flood tests; here every message goes deep.
        intake={
            "telemetry_per_s": 10_000,
            "telemetry_burst": 100_000,
            "messages_per_s": 10_000,
            "messages_burst": 100_000,
            "bytes_per_s": 1e12,
            "bytes_burst": 2**40,
            "source_per_s": 10_000,
            "source_burst": 100_000,
        },
    )
    broker = MemoryBroker()
    agg = Aggregator(
        settings,
        sinks=[MemorySink(max_points=20_000)],
        clock_ns=clock.wall,
        mono_ns=clock.mono,
        bus_factory=broker.bus,
    )
    asyncio.run(agg.start())  # its warm-up counts from clock.mono()
    bus = agg.bus
    assert isinstance(bus, MemoryBus)
    bus.connect()
    return agg


@dataclass
class Findings:
    """What a fuzz run found."""

    messages: int = 0
    steps: int = 0
    accepted: int = 0
    internal: int = 0
    step_failures: int = 0
    escaped: list[str] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    implausible: Counter[str] = field(default_factory=Counter)
    levels: Counter[int] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def exceptions(self) -> int:
        """Exceptions escaping a handler or step, or caught by a last-resort guard."""
        return len(self.escaped) + self.internal + self.step_failures


def run(tmp: Path, policy: Path, *, seed: int, messages: int, step_every: int = 10) -> Findings:
    """Fuzz one aggregator with ``messages`` messages, a control step every ``step_every``."""
    rng = random.Random(seed)  # noqa: S311 - reproducible draws, not secrets
    clock = FakeClock()
    agg = aggregator(tmp, policy, clock)
    found = Findings()
    started = time.perf_counter()
    for i in range(messages):
        clock.advance(rng.choice((0.0, 0.001, 0.1, 2.0, 30.0)) if i % 50 == 0 else 0.01)
        msg = message(rng, clock.wall())
        msg = InMessage(msg.topic, msg.payload, msg.retain, clock.wall(), clock.mono())
        before = agg.intake.drops.total
        try:
            agg.handle_message(msg)
        except Exception as exc:  # a finding: handle_message must never raise
            found.escaped.append(f"handle {msg.topic}: {exc!r}"[:300])
        found.accepted += agg.intake.drops.total == before
        found.messages += 1
        if i % step_every == step_every - 1:
            try:
                result = agg.control_step(clock.mono() / 1e9)
            except Exception as exc:  # a finding: control_step must never raise
                found.escaped.append(f"step: {exc!r}"[:300])
                result = None
            found.steps += 1
            if result is not None:
                found.levels.update(row.decision.level for row in result.rows)
    found.internal = agg.intake.drops.counts["internal"]
    found.step_failures = agg.step_failures.total
    found.dropped = agg.intake.drops.counts
    found.implausible = Counter(agg.intake.implausible)
    found.seconds = time.perf_counter() - started
    return found
