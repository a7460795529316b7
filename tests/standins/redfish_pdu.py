"""The ``pdu`` device of the Redfish stand-in: a rack PDU fed by two mains (DSP0268).

``resources(name[, option])`` builds the tree of one ``PowerDistribution``
(``PowerEquipment/RackPDUs/{name}``, ``EquipmentType: "RackPDU"``): its ``Mains``
collection (``AC1`` and ``AC2``, the A and B feeds; option ``single``: ``AC1`` only), each
a three-phase ``Circuit`` with ``PowerWatts``, ``PolyPhasePowerWatts`` (line to neutral),
``CurrentAmps``, ``Voltage``, ``PolyPhaseCurrentAmps``/``PolyPhaseVoltage`` and
``EnergykWh``; its ``Branches`` (two per main, each half of its main's power); and its
``Metrics`` (``PowerDistributionMetrics``: the PDU's total). The server serves the
service root, ``PowerEquipment`` and the ``RackPDUs`` collection itself.

``set_state(docs, name, state)`` (``POST /_standin/state``) changes the power:
``{"mains": {"AC1": 5200.0, "AC2": 4800.0}}`` per main, or ``{"power_w": x}`` split
evenly; ``"report"`` picks what the circuits carry (``power``: everything, the default;
``polyphase``: no ``PowerWatts``; ``current``: only current and voltage);
``"energy_kwh"`` sets each main's counter; ``"voltage"`` the line-to-neutral voltage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["resources", "set_state"]

_ROOT = "/redfish/v1/PowerEquipment/RackPDUs"
_LINES = ("Line1", "Line2", "Line3")
_REPORTS = frozenset({"power", "polyphase", "current"})


@dataclass
class _Pdu:
    mains_w: dict[str, float]
    energy_kwh: dict[str, float] = field(default_factory=dict)
    report: str = "power"
    voltage: float = 230.0


_PDUS: dict[str, _Pdu] = {}


def _collection(path: str, kind: str, members: list[str]) -> dict[str, Any]:
    return {
        "@odata.id": path,
        "@odata.type": f"#{kind}Collection.{kind}Collection",
        "Name": f"{kind} Collection",
        "Members": [{"@odata.id": f"{path}/{m}"} for m in members],
        "Members@odata.count": len(members),
    }


def _circuit(
    pdu: _Pdu, path: str, cid: str, *, kind: str, power_w: float, energy: float
) -> dict[str, Any]:
    sensors = path.rsplit("/", 2)[0] + "/Sensors"
    line_w = power_w / 3
    amps = line_w / pdu.voltage
    doc: dict[str, Any] = {
        "@odata.id": path,
        "@odata.type": "#Circuit.v1_8_0.Circuit",
        "Id": cid,
        "Name": f"{kind} {cid}",
        "CircuitType": kind,
        "PhaseWiringType": "ThreePhase5Wire",
        "NominalVoltage": "AC400V",
        "RatedCurrentAmps": 32,
        "BreakerState": "Normal",
        "Status": {"State": "Enabled", "Health": "OK"},
        "Voltage": {"DataSourceUri": f"{sensors}/{cid}Voltage", "Reading": pdu.voltage},
        "CurrentAmps": {"DataSourceUri": f"{sensors}/{cid}Current", "Reading": round(amps, 3)},
        "PolyPhaseVoltage": {
            f"{line}ToNeutral": {"DataSourceUri": f"{sensors}/{cid}V{line}", "Reading": pdu.voltage}
            for line in _LINES
        },
        "PolyPhaseCurrentAmps": {
            line: {"DataSourceUri": f"{sensors}/{cid}I{line}", "Reading": round(amps, 3)}
            for line in _LINES
        },
        "PowerWatts": {
            "DataSourceUri": f"{sensors}/{cid}Power",
            "Reading": power_w,
            "ApparentVA": power_w,
            "PowerFactor": 1.0,
        },
        "PolyPhasePowerWatts": {
            f"{line}ToNeutral": {"DataSourceUri": f"{sensors}/{cid}P{line}", "Reading": line_w}
            for line in _LINES
        },
        "EnergykWh": {"DataSourceUri": f"{sensors}/{cid}Energy", "Reading": energy},
        "FrequencyHz": {"DataSourceUri": f"{sensors}/{cid}Frequency", "Reading": 50.0},
    }
    if pdu.report in {"polyphase", "current"}:
        del doc["PowerWatts"]
    if pdu.report == "current":
        del doc["PolyPhasePowerWatts"]
        # one phase carries it all, so current x voltage is the whole power
        doc["CurrentAmps"]["Reading"] = power_w / pdu.voltage
    return doc


def _build(name: str, pdu: _Pdu) -> dict[str, dict[str, Any]]:
    base = f"{_ROOT}/{name}"
    mains = list(pdu.mains_w)
    branches = {f"{m}{b}": m for m in mains for b in ("A", "B")}
    total_w = sum(pdu.mains_w.values())
    docs: dict[str, dict[str, Any]] = {
        base: {
            "@odata.id": base,
            "@odata.type": "#PowerDistribution.v1_3_0.PowerDistribution",
            "Id": name,
            "Name": f"Rack PDU {name}",
            "EquipmentType": "RackPDU",
            "Manufacturer": "Contoso",
            "Model": "ZAP4000",
            "SerialNumber": f"PDU-{name}",
            "FirmwareVersion": "4.3.0",
            "Status": {"State": "Enabled", "Health": "OK"},
            "Mains": {"@odata.id": f"{base}/Mains"},
            "Branches": {"@odata.id": f"{base}/Branches"},
            "Metrics": {"@odata.id": f"{base}/Metrics"},
        },
        f"{base}/Mains": _collection(f"{base}/Mains", "Circuit", mains),
        f"{base}/Branches": _collection(f"{base}/Branches", "Circuit", list(branches)),
        f"{base}/Metrics": {
            "@odata.id": f"{base}/Metrics",
            "@odata.type": "#PowerDistributionMetrics.v1_3_0.PowerDistributionMetrics",
            "Id": "Metrics",
            "Name": f"Metrics of {name}",
            "PowerWatts": {"DataSourceUri": f"{base}/Sensors/Power", "Reading": total_w},
            "EnergykWh": {
                "DataSourceUri": f"{base}/Sensors/Energy",
                "Reading": sum(pdu.energy_kwh.get(m, 0.0) for m in mains),
            },
        },
    }
    for main, power_w in pdu.mains_w.items():
        path = f"{base}/Mains/{main}"
        docs[path] = _circuit(
            pdu, path, main, kind="Mains", power_w=power_w, energy=pdu.energy_kwh.get(main, 0.0)
        )
    for branch, main in branches.items():
        path = f"{base}/Branches/{branch}"
        energy = pdu.energy_kwh.get(main, 0.0) / 2
        docs[path] = _circuit(
            pdu, path, branch, kind="Branch", power_w=pdu.mains_w[main] / 2, energy=energy
        )
    return docs


def resources(name: str, option: str | None = None) -> dict[str, dict[str, Any]]:
    """The documents of PDU ``name`` (option ``single``: one main), by ``@odata.id``."""
    if option not in {None, "single"}:
        msg = f"pdu option {option!r}: expected single"
        raise ValueError(msg)
    mains = {"AC1": 2500.0} if option == "single" else {"AC1": 2500.0, "AC2": 2500.0}
    pdu = _Pdu(mains_w=mains, energy_kwh=dict.fromkeys(mains, 1234.5))
    _PDUS[name] = pdu
    return _build(name, pdu)


def set_state(docs: dict[str, dict[str, Any]], name: str, state: Mapping[str, Any]) -> None:
    """Change PDU ``name``'s power (see the module docstring); ``ValueError`` if bad."""
    pdu = _PDUS[name]
    if "mains" in state:
        mains = dict(state["mains"])
        unknown = set(mains) - set(pdu.mains_w)
        if unknown:
            msg = f"PDU {name} has no mains {sorted(unknown)}"
            raise ValueError(msg)
        pdu.mains_w.update({k: float(v) for k, v in mains.items()})
    if "power_w" in state:
        share = float(state["power_w"]) / len(pdu.mains_w)
        pdu.mains_w = dict.fromkeys(pdu.mains_w, share)
    if "energy_kwh" in state:
        pdu.energy_kwh = dict.fromkeys(pdu.mains_w, float(state["energy_kwh"]))
    if "voltage" in state:
        pdu.voltage = float(state["voltage"])
    if "report" in state:
        if state["report"] not in _REPORTS:
            msg = f"report {state['report']!r}: expected one of {sorted(_REPORTS)}"
            raise ValueError(msg)
        pdu.report = state["report"]
    docs.update(_build(name, pdu))
