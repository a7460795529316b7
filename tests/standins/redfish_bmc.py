"""The ``bmc`` device of the Redfish stand-in: one node's power limit, in either shape.

``resources(name, option)`` builds the resource tree of one BMC; the option picks the
shape of its power limit (platform-facts 12.2):

- ``controls`` (default): ``Chassis/{name}`` (``RackMount``) with ``Controls/NodePower``
  (``ControlType: "Power"``, ``SetPoint``, ``AllowableMin``/``AllowableMax``, a ``Sensor``
  excerpt whose ``DataSourceUri`` is ``Sensors/TotalPower``), a temperature control before
  it, and the legacy ``Power`` resource as well (as real BMCs keep it). Listed before the
  node's chassis is ``Chassis/{name}_Baseboard`` (``Module``) with its own read-only power
  control: a reader must prefer the node's chassis over a sub-component.
- ``legacy``: ``Chassis/{name}`` with only ``Power`` -> ``PowerControl[0]``
  (``PowerLimit.LimitInWatts`` with ``@Redfish.AllowableNumbers``, ``PowerConsumedWatts``,
  ``PowerCapacityWatts``).

Variants of ``controls`` with several power controls on the node's chassis, as DMTF's
liquid-cooled-server mockup has them (the Control schema's ``PhysicalContext`` and
``SetPointUnits``):

- ``cpu_first``: ``Controls/CPUPower`` (``PhysicalContext: "CPU"``, 20-120 W, writable: a
  write lands on the CPU's limit, not the node's) listed before ``NodePower``
  (``PhysicalContext: "Chassis"``);
- ``ambiguous``: ``NodePower`` and ``Controls/PowerLimit2``, both without a
  ``PhysicalContext``, and no ``EnvironmentMetrics`` to tell them apart;
- ``by_sensor``: the same two, and the chassis's ``EnvironmentMetrics.PowerWatts`` naming
  ``Sensors/TotalPower``, the sensor of ``NodePower`` only;
- ``mw``: ``NodePower`` in ``SetPointUnits: "mW"`` (its set point, range and PATCHes in
  milliwatts).

The draw follows the limit as a real server's would: ``power_w = min(load_w, limit_w)``.
``patch`` applies a PATCH (``SetPoint`` or ``LimitInWatts``) or returns the message of the
HTTP 400 a BMC answers for a value outside the allowable range; ``set_state`` changes the
load, the limit or the range for a test (``POST /_standin/state``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["patch", "resources", "set_state"]


@dataclass
class _Bmc:
    shape: str
    load_w: float = 900.0
    limit_w: float | None = 1200.0
    min_w: float = 300.0
    max_w: float = 1500.0
    capacity_w: float = 1500.0
    excerpt_reading: bool = True
    cpu_limit_w: float = 120.0  # cpu_first: the CPU's own power limit

    @property
    def per_unit(self) -> float:
        """The node control's unit in W (``mw``: 0.001)."""
        return 1e-3 if self.shape == "mw" else 1.0

    @property
    def power_w(self) -> float:
        return self.load_w if self.limit_w is None else min(self.load_w, self.limit_w)


_BMCS: dict[str, _Bmc] = {}
_SHAPES = frozenset({"controls", "legacy", "cpu_first", "ambiguous", "by_sensor", "mw"})
_STATE_KEYS = frozenset(
    {"load_w", "limit_w", "min_w", "max_w", "capacity_w", "excerpt_reading", "cpu_limit_w"}
)


def _paths(name: str) -> dict[str, str]:
    node = f"/redfish/v1/Chassis/{name}"
    return {
        "board": f"{node}_Baseboard",
        "node": node,
        "controls": f"{node}/Controls",
        "control": f"{node}/Controls/NodePower",
        "temp": f"{node}/Controls/CPUTemp",
        "cpu": f"{node}/Controls/CPUPower",
        "other": f"{node}/Controls/PowerLimit2",
        "metrics": f"{node}/EnvironmentMetrics",
        "other_sensor": f"{node}/Sensors/CPUPower",
        "sensors": f"{node}/Sensors",
        "sensor": f"{node}/Sensors/TotalPower",
        "power": f"{node}/Power",
    }


def resources(name: str, option: str | None = None) -> dict[str, dict[str, Any]]:
    """The resource tree of BMC ``name`` in shape ``option`` (``controls`` or ``legacy``)."""
    shape = option or "controls"
    if shape not in _SHAPES:
        msg = f"bmc {name}: unknown shape {shape!r} ({', '.join(sorted(_SHAPES))})"
        raise ValueError(msg)
    bmc = _BMCS[name] = _Bmc(shape=shape)
    p = _paths(name)
    docs: dict[str, dict[str, Any]] = {}
    if shape != "legacy":
        board = p["board"]
        docs[board] = {
            "@odata.id": board,
            "@odata.type": "#Chassis.v1_23_0.Chassis",
            "Id": f"{name}_Baseboard",
            "Name": "GPU baseboard",
            "ChassisType": "Module",
            "Controls": {"@odata.id": f"{board}/Controls"},
        }
        docs[f"{board}/Controls"] = _collection(f"{board}/Controls", [f"{board}/Controls/GPU"])
        docs[f"{board}/Controls/GPU"] = {
            "@odata.id": f"{board}/Controls/GPU",
            "@odata.type": "#Control.v1_3_0.Control",
            "Id": "GPU",
            "ControlType": "Power",
            "SetPoint": 700,
            "AllowableMin": 200,
            "AllowableMax": 700,
            "Sensor": {"Reading": 650},
        }
    node: dict[str, Any] = {
        "@odata.id": p["node"],
        "@odata.type": "#Chassis.v1_23_0.Chassis",
        "Id": name,
        "Name": f"{name} chassis",
        "ChassisType": "RackMount",
        "Power": {"@odata.id": p["power"]},
    }
    docs[p["node"]] = node
    if shape != "legacy":
        node["Controls"] = {"@odata.id": p["controls"]}
        node["Sensors"] = {"@odata.id": p["sensors"]}
        members = [p["temp"], p["control"]]
        if shape == "cpu_first":
            members = [p["temp"], p["cpu"], p["control"]]
        elif shape in {"ambiguous", "by_sensor"}:
            members = [p["temp"], p["other"], p["control"]]
        docs[p["controls"]] = _collection(p["controls"], members)
        docs[p["temp"]] = {
            "@odata.id": p["temp"],
            "@odata.type": "#Control.v1_3_0.Control",
            "Id": "CPUTemp",
            "ControlType": "Temperature",
            "SetPoint": 85,
        }
        docs[p["control"]] = {
            "@odata.id": p["control"],
            "@odata.type": "#Control.v1_3_0.Control",
            "Id": "NodePower",
            "ControlType": "Power",
            "SetPointUnits": "mW" if shape == "mw" else "W",
            "ControlMode": "Automatic",
        }
        if shape == "cpu_first":
            docs[p["control"]]["PhysicalContext"] = "Chassis"
            docs[p["cpu"]] = {
                "@odata.id": p["cpu"],
                "@odata.type": "#Control.v1_3_0.Control",
                "Id": "CPUPower",
                "ControlType": "Power",
                "PhysicalContext": "CPU",
                "SetPointUnits": "W",
                "AllowableMin": 20,
                "AllowableMax": 120,
                "Sensor": {"DataSourceUri": p["other_sensor"]},
            }
        if shape in {"ambiguous", "by_sensor"}:
            docs[p["other"]] = {
                "@odata.id": p["other"],
                "@odata.type": "#Control.v1_3_0.Control",
                "Id": "PowerLimit2",
                "ControlType": "Power",
                "SetPointUnits": "W",
                "SetPoint": 500,
                "AllowableMin": 100,
                "AllowableMax": 800,
                "Sensor": {"DataSourceUri": p["other_sensor"], "Reading": 300},
            }
        if shape == "by_sensor":
            node["EnvironmentMetrics"] = {"@odata.id": p["metrics"]}
            docs[p["metrics"]] = {
                "@odata.id": p["metrics"],
                "@odata.type": "#EnvironmentMetrics.v1_3_0.EnvironmentMetrics",
                "PowerWatts": {"DataSourceUri": p["sensor"]},
            }
        docs[p["sensors"]] = _collection(p["sensors"], [p["sensor"]])
        docs[p["sensor"]] = {
            "@odata.id": p["sensor"],
            "@odata.type": "#Sensor.v1_9_0.Sensor",
            "Id": "TotalPower",
            "ReadingType": "Power",
            "ReadingUnits": "W",
        }
    docs[p["power"]] = {
        "@odata.id": p["power"],
        "@odata.type": "#Power.v1_7_1.Power",
        "Id": "Power",
        "PowerControl": [{"@odata.id": f"{p['power']}#/PowerControl/0", "MemberId": "0"}],
    }
    _render(docs, name, bmc)
    return docs


def _collection(path: str, members: list[str]) -> dict[str, Any]:
    return {
        "@odata.id": path,
        "Members": [{"@odata.id": m} for m in members],
        "Members@odata.count": len(members),
    }


def _render(docs: dict[str, dict[str, Any]], name: str, bmc: _Bmc) -> None:
    """Write the BMC's state into its documents (in place: the server serves these)."""
    p = _paths(name)
    if bmc.shape != "legacy":
        control = docs[p["control"]]
        unit = bmc.per_unit
        control["SetPoint"] = None if bmc.limit_w is None else bmc.limit_w / unit
        control["AllowableMin"] = bmc.min_w / unit
        control["AllowableMax"] = bmc.max_w / unit
        if bmc.shape == "cpu_first":
            docs[p["cpu"]]["SetPoint"] = bmc.cpu_limit_w
        sensor: dict[str, Any] = {"DataSourceUri": p["sensor"]}
        if bmc.excerpt_reading:
            sensor["Reading"] = bmc.power_w
        control["Sensor"] = sensor
        docs[p["sensor"]]["Reading"] = bmc.power_w
    power_control = docs[p["power"]]["PowerControl"][0]
    power_control["PowerConsumedWatts"] = bmc.power_w
    power_control["PowerCapacityWatts"] = bmc.capacity_w
    power_control["PowerLimit"] = {
        "LimitInWatts": bmc.limit_w,
        "LimitInWatts@Redfish.AllowableNumbers": [f"{bmc.min_w:g}:{bmc.max_w:g}"],
        "LimitException": "LogEventOnly",
    }


def set_state(docs: dict[str, dict[str, Any]], name: str, state: Mapping[str, Any]) -> None:
    """Change BMC ``name``: ``load_w``, ``limit_w``, ``min_w``, ``max_w``, ``capacity_w``,
    ``excerpt_reading`` (whether the control's ``Sensor`` excerpt carries its reading)."""
    unknown = set(state) - _STATE_KEYS
    if unknown:
        msg = f"bmc {name}: unknown state {sorted(unknown)} (known: {sorted(_STATE_KEYS)})"
        raise ValueError(msg)
    bmc = _BMCS[name]
    for key, value in state.items():
        setattr(bmc, key, value)
    _render(docs, name, bmc)


def patch(
    docs: dict[str, dict[str, Any]], name: str, path: str, body: Mapping[str, Any]
) -> str | None:
    """Apply a PATCH of ``path``; the message of a 400 when the BMC refuses it, else None."""
    bmc = _BMCS[name]
    p = _paths(name)
    if path == p["control"] and bmc.shape != "legacy":
        if set(body) - {"SetPoint", "ControlMode"}:
            return f"only SetPoint and ControlMode are writable, not {sorted(body)}"
        if "SetPoint" in body:
            problem = _out_of_range(bmc, body["SetPoint"], allow_null=False, unit_w=bmc.per_unit)
            if problem:
                return problem
            bmc.limit_w = float(body["SetPoint"]) * bmc.per_unit
    elif path == p["cpu"] and bmc.shape == "cpu_first":
        value = body.get("SetPoint")
        if (
            set(body) != {"SetPoint"}
            or isinstance(value, bool)
            or not isinstance(value, int | float)
        ):
            return "only a numeric SetPoint is writable"
        if not 20 <= value <= 120:
            return f"the value {value} is out of the range 20..120 W"
        bmc.cpu_limit_w = float(value)
    elif path == p["power"]:
        controls = body.get("PowerControl")
        if set(body) != {"PowerControl"} or not isinstance(controls, list) or not controls:
            return "PATCH PowerControl[0].PowerLimit.LimitInWatts only"
        limit = controls[0].get("PowerLimit") if isinstance(controls[0], dict) else None
        if not isinstance(limit, dict) or "LimitInWatts" not in limit:
            return "PowerControl[0].PowerLimit.LimitInWatts is missing"
        problem = _out_of_range(bmc, limit["LimitInWatts"], allow_null=True)
        if problem:
            return problem
        value = limit["LimitInWatts"]
        bmc.limit_w = None if value is None else float(value)
    else:
        return f"{path} is read-only"
    _render(docs, name, bmc)
    return None


def _out_of_range(bmc: _Bmc, value: object, *, allow_null: bool, unit_w: float = 1.0) -> str | None:
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"the value {value!r} is not a number"
    if not bmc.min_w <= value * unit_w <= bmc.max_w:
        low, high = bmc.min_w / unit_w, bmc.max_w / unit_w
        return f"the value {value} is out of the range {low:g}..{high:g}"
    return None
