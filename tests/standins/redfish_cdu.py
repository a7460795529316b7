"""The ``cdu`` device of the Redfish stand-in: a liquid-to-liquid CDU (DSP0268 ``CoolingUnit``).

``resources(name)`` builds the tree of one ``CoolingUnit`` at
``ThermalEquipment/CDUs/{name}``, shaped like the OCP CDU profile's examples: one primary
(facility) and one secondary (racks) ``CoolantConnector`` with supply/return temperature,
flow, delta pressure and heat removed as sensor excerpts; two ``Pumps`` (``1`` running,
``2`` a standby spare) with ``PumpSpeedPercent``; one ``Filter``; ``LeakDetection`` with a
``LeakDetectorGroups`` summary (``DetectorState`` excerpts) and a ``LeakDetectors``
collection (``Tray`` and ``Floor``); ``EnvironmentMetrics`` (the CDU's own power) and
``CoolingCapacityWatts``. The server serves the service root, ``ThermalEquipment`` and
the ``CDUs`` collection itself.

``set_state(docs, name, state)`` (``POST /_standin/state``) changes: ``supply_c``,
``return_c``, ``flow_lpm``, ``delta_pressure_kpa``, ``heat_kw`` (secondary side),
``primary_supply_c``, ``primary_return_c``, ``primary_flow_lpm``; ``pumps`` ``{"1":
"running"|"standby"|"failed"|"off"}``; ``pump_speed_pct``; ``leak`` (``"OK"``,
``"Warning"``, ``"Critical"``: the ``Tray`` detector) or ``leaks`` ``{"Floor": ...}``;
``health`` (the unit's ``Status.Health``); ``filter_health``; ``raw`` ``{path: {key:
value}}`` to plant any value in any document (hostile-value tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["resources", "set_state"]

_ROOT = "/redfish/v1/ThermalEquipment/CDUs"
_PUMP_STATUS = {
    "running": {"State": "Enabled", "Health": "OK"},
    "standby": {"State": "StandbySpare", "Health": "OK"},
    "failed": {"State": "Enabled", "Health": "Critical"},
    "off": {"State": "Disabled", "Health": "OK"},
}
_STATES = frozenset({"OK", "Warning", "Critical"})


@dataclass
class _Cdu:
    secondary: dict[str, float] = field(
        default_factory=lambda: {
            "SupplyTemperatureCelsius": 30.0,
            "ReturnTemperatureCelsius": 40.0,
            "FlowLitersPerMinute": 150.0,
            "DeltaPressurekPa": 80.0,
            "HeatRemovedkW": 60.0,
        }
    )
    primary: dict[str, float] = field(
        default_factory=lambda: {
            "SupplyTemperatureCelsius": 22.0,
            "ReturnTemperatureCelsius": 34.0,
            "FlowLitersPerMinute": 120.0,
        }
    )
    pumps: dict[str, str] = field(default_factory=lambda: {"1": "running", "2": "standby"})
    pump_speed_pct: float = 62.5
    leaks: dict[str, str] = field(default_factory=lambda: {"Tray": "OK", "Floor": "OK"})
    health: str = "OK"
    filter_health: str = "OK"
    raw: dict[str, dict[str, Any]] = field(default_factory=dict)


_CDUS: dict[str, _Cdu] = {}
_SECONDARY = {
    "supply_c": "SupplyTemperatureCelsius",
    "return_c": "ReturnTemperatureCelsius",
    "flow_lpm": "FlowLitersPerMinute",
    "delta_pressure_kpa": "DeltaPressurekPa",
    "heat_kw": "HeatRemovedkW",
}
_PRIMARY = {
    "primary_supply_c": "SupplyTemperatureCelsius",
    "primary_return_c": "ReturnTemperatureCelsius",
    "primary_flow_lpm": "FlowLitersPerMinute",
}


def _collection(path: str, kind: str, members: list[str]) -> dict[str, Any]:
    return {
        "@odata.id": path,
        "@odata.type": f"#{kind}Collection.{kind}Collection",
        "Name": f"{kind} Collection",
        "Members": [{"@odata.id": f"{path}/{m}"} for m in members],
        "Members@odata.count": len(members),
    }


def _connector(path: str, side: str, readings: Mapping[str, float]) -> dict[str, Any]:
    sensors = f"/redfish/v1/Chassis/{path.split('/')[5]}/Sensors"
    doc: dict[str, Any] = {
        "@odata.id": path,
        "@odata.type": "#CoolantConnector.v1_1_0.CoolantConnector",
        "Id": "1",
        "Name": f"{side} side connector 1",
        "Status": {"State": "Enabled", "Health": "OK"},
        "CoolantConnectorType": "Pair",
        "Coolant": {"CoolantType": "Water", "DensityKgPerCubicMeter": 1030},
        "RatedFlowLitersPerMinute": 200,
    }
    for key, value in readings.items():
        doc[key] = {"Reading": value, "DataSourceUri": f"{sensors}/{side}{key}"}
    return doc


def _worst(states: list[str]) -> str:
    for state in ("Critical", "Warning"):
        if state in states:
            return state
    return "OK"


def _build(name: str, cdu: _Cdu) -> dict[str, dict[str, Any]]:
    base = f"{_ROOT}/{name}"
    leak = f"{base}/LeakDetection"
    docs: dict[str, dict[str, Any]] = {
        base: {
            "@odata.id": base,
            "@odata.type": "#CoolingUnit.v1_2_0.CoolingUnit",
            "Id": name,
            "Name": f"CDU {name}",
            "EquipmentType": "CDU",
            "Manufacturer": "Contoso",
            "Model": "LCOOL6000",
            "SerialNumber": f"CDU-{name}",
            "FirmwareVersion": "1.0.0",
            "Status": {"State": "Enabled", "Health": cdu.health},
            "Coolant": {"CoolantType": "Water", "DensityKgPerCubicMeter": 1030},
            "CoolingCapacityWatts": 100_000,
            "EnvironmentMetrics": {"@odata.id": f"{base}/EnvironmentMetrics"},
            "PrimaryCoolantConnectors": {"@odata.id": f"{base}/PrimaryCoolantConnectors"},
            "SecondaryCoolantConnectors": {"@odata.id": f"{base}/SecondaryCoolantConnectors"},
            "Pumps": {"@odata.id": f"{base}/Pumps"},
            "Filters": {"@odata.id": f"{base}/Filters"},
            "LeakDetection": {"@odata.id": leak},
        },
        f"{base}/EnvironmentMetrics": {
            "@odata.id": f"{base}/EnvironmentMetrics",
            "@odata.type": "#EnvironmentMetrics.v1_3_0.EnvironmentMetrics",
            "Id": "EnvironmentMetrics",
            "Name": f"Environment metrics of {name}",
            "PowerWatts": {"Reading": 2100.0},
            "EnergykWh": {"Reading": 3616.0},
        },
        f"{base}/Filters": _collection(f"{base}/Filters", "Filter", ["1"]),
        f"{base}/Filters/1": {
            "@odata.id": f"{base}/Filters/1",
            "@odata.type": "#Filter.v1_0_2.Filter",
            "Id": "1",
            "Name": "Internal filter",
            "ServiceHours": 354,
            "RatedServiceHours": 7500,
            "Status": {"State": "Enabled", "Health": cdu.filter_health},
        },
        f"{base}/Pumps": _collection(f"{base}/Pumps", "Pump", list(cdu.pumps)),
        leak: {
            "@odata.id": leak,
            "@odata.type": "#LeakDetection.v1_1_0.LeakDetection",
            "Id": "LeakDetection",
            "Name": f"Leak detection of {name}",
            "Status": {"State": "Enabled", "Health": _worst(list(cdu.leaks.values()))},
            "LeakDetectorGroups": [
                {
                    "GroupName": "Detectors in the CDU",
                    "Detectors": [
                        {
                            "DataSourceUri": f"{leak}/LeakDetectors/{d}",
                            "DeviceName": f"{d} leak detector",
                            "DetectorState": state,
                        }
                        for d, state in cdu.leaks.items()
                    ],
                    "Status": {"State": "Enabled", "Health": _worst(list(cdu.leaks.values()))},
                }
            ],
            "LeakDetectors": {"@odata.id": f"{leak}/LeakDetectors"},
        },
        f"{leak}/LeakDetectors": _collection(
            f"{leak}/LeakDetectors", "LeakDetector", list(cdu.leaks)
        ),
    }
    for side, readings in (("Secondary", cdu.secondary), ("Primary", cdu.primary)):
        coll = f"{base}/{side}CoolantConnectors"
        docs[coll] = _collection(coll, "CoolantConnector", ["1"])
        docs[f"{coll}/1"] = _connector(f"{coll}/1", side, readings)
    for pump, state in cdu.pumps.items():
        path = f"{base}/Pumps/{pump}"
        speed = cdu.pump_speed_pct if state == "running" else 0.0
        docs[path] = {
            "@odata.id": path,
            "@odata.type": "#Pump.v1_1_0.Pump",
            "Id": pump,
            "Name": f"Secondary pump {pump}",
            "PumpType": "Liquid",
            "Status": dict(_PUMP_STATUS[state]),
            "PumpSpeedPercent": {"Reading": speed},
        }
    for detector, state in cdu.leaks.items():
        path = f"{leak}/LeakDetectors/{detector}"
        docs[path] = {
            "@odata.id": path,
            "@odata.type": "#LeakDetector.v1_1_0.LeakDetector",
            "Id": detector,
            "Name": f"{detector} leak detector",
            "LeakDetectorType": "Moisture",
            "DetectorState": state,
            "Status": {"State": "Enabled", "Health": state},
        }
    for path, values in cdu.raw.items():
        docs.setdefault(path, {}).update(values)
    return docs


def resources(name: str) -> dict[str, dict[str, Any]]:
    """The documents of CDU ``name``, by ``@odata.id``."""
    cdu = _Cdu()
    _CDUS[name] = cdu
    return _build(name, cdu)


def set_state(docs: dict[str, dict[str, Any]], name: str, state: Mapping[str, Any]) -> None:
    """Change CDU ``name`` (see the module docstring); ``ValueError`` for a bad state."""
    cdu = _CDUS[name]
    for key, prop in _SECONDARY.items():
        if key in state:
            cdu.secondary[prop] = float(state[key])
    for key, prop in _PRIMARY.items():
        if key in state:
            cdu.primary[prop] = float(state[key])
    for pump, pump_state in dict(state.get("pumps", {})).items():
        if pump not in cdu.pumps or pump_state not in _PUMP_STATUS:
            msg = f"pump {pump!r} state {pump_state!r}: pumps {sorted(cdu.pumps)}"
            msg += f", states {sorted(_PUMP_STATUS)}"
            raise ValueError(msg)
        cdu.pumps[pump] = pump_state
    if "pump_speed_pct" in state:
        cdu.pump_speed_pct = float(state["pump_speed_pct"])
    leaks = dict(state.get("leaks", {}))
    if "leak" in state:
        leaks["Tray"] = state["leak"]
    for detector, leak_state in leaks.items():
        if detector not in cdu.leaks or leak_state not in _STATES:
            msg = f"leak detector {detector!r} state {leak_state!r}: one of {sorted(_STATES)}"
            raise ValueError(msg)
        cdu.leaks[detector] = leak_state
    for key in ("health", "filter_health"):
        if key in state:
            if state[key] not in _STATES:
                msg = f"{key} {state[key]!r}: expected one of {sorted(_STATES)}"
                raise ValueError(msg)
            setattr(cdu, key, state[key])
    for path, values in dict(state.get("raw", {})).items():
        cdu.raw.setdefault(path, {}).update(dict(values))
    docs.update(_build(name, cdu))
