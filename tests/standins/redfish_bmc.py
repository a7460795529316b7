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

    @property
    def power_w(self) -> float:
        return self.load_w if self.limit_w is None else min(self.load_w, self.limit_w)


_BMCS: dict[str, _Bmc] = {}
_STATE_KEYS = frozenset({"load_w", "limit_w", "min_w", "max_w", "capacity_w", "excerpt_reading"})


def _paths(name: str) -> dict[str, str]:
    node = f"/redfish/v1/Chassis/{name}"
    return {
        "board": f"{node}_Baseboard",
        "node": node,
        "controls": f"{node}/Controls",
        "control": f"{node}/Controls/NodePower",
        "temp": f"{node}/Controls/CPUTemp",
        "sensors": f"{node}/Sensors",
        "sensor": f"{node}/Sensors/TotalPower",
        "power": f"{node}/Power",
    }


def resources(name: str, option: str | None = None) -> dict[str, dict[str, Any]]:
    """The resource tree of BMC ``name`` in shape ``option`` (``controls`` or ``legacy``)."""
    shape = option or "controls"
    if shape not in {"controls", "legacy"}:
        msg = f"bmc {name}: unknown shape {shape!r} (controls, legacy)"
        raise ValueError(msg)
    bmc = _BMCS[name] = _Bmc(shape=shape)
    p = _paths(name)
    docs: dict[str, dict[str, Any]] = {}
    if shape == "controls":
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
    if shape == "controls":
        node["Controls"] = {"@odata.id": p["controls"]}
        node["Sensors"] = {"@odata.id": p["sensors"]}
        docs[p["controls"]] = _collection(p["controls"], [p["temp"], p["control"]])
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
            "SetPointUnits": "W",
            "ControlMode": "Automatic",
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
    if bmc.shape == "controls":
        control = docs[p["control"]]
        control["SetPoint"] = bmc.limit_w
        control["AllowableMin"] = bmc.min_w
        control["AllowableMax"] = bmc.max_w
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
    if path == p["control"] and bmc.shape == "controls":
        if set(body) - {"SetPoint", "ControlMode"}:
            return f"only SetPoint and ControlMode are writable, not {sorted(body)}"
        if "SetPoint" in body:
            problem = _out_of_range(bmc, body["SetPoint"], allow_null=False)
            if problem:
                return problem
            bmc.limit_w = float(body["SetPoint"])
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


def _out_of_range(bmc: _Bmc, value: object, *, allow_null: bool) -> str | None:
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"the value {value!r} is not a number"
    if not bmc.min_w <= value <= bmc.max_w:
        return f"the value {value} is out of the range {bmc.min_w:g}..{bmc.max_w:g} W"
    return None
