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

Feed state, as DSP0268's ``Circuit`` has it: each main keeps a ``BreakerState``
(``Normal``, ``Tripped``, ``Off``) and a ``PowerState`` (``On``, ``Off``, ``PoweringOn``,
``PoweringOff``, ``Paused``): ``{"breakers": {"AC2": "Tripped"}}``,
``{"power_states": {"AC1": "Off"}}``. A main carries its power only while its breaker is
``Normal`` and its power ``On``; otherwise it and its branches read 0 W and 0 A, and a
main whose breaker is not ``Normal`` reads ``PowerState`` ``Off`` (its branches too, their
own breakers ``Normal``). The inlet's voltage stays (the breaker is on the PDU's side of
it); ``"voltage": 0`` is a feed lost upstream. Going dark
(``{"dark": true}``: the PDU answers nothing, as one powered by a lost feed) is the
server's, for every kind of device (``tests/standins/redfish.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["resources", "set_state"]

_ROOT = "/redfish/v1/PowerEquipment/RackPDUs"
_LINES = ("Line1", "Line2", "Line3")
_REPORTS = frozenset({"power", "polyphase", "current"})
BREAKER_STATES = frozenset({"Normal", "Tripped", "Off"})
"""DSP0268 ``Circuit.BreakerState``."""
POWER_STATES = frozenset({"On", "Off", "PoweringOn", "PoweringOff", "Paused"})
"""DSP0268 ``Resource.PowerState``."""


@dataclass
class _Pdu:
    mains_w: dict[str, float]
    energy_kwh: dict[str, float] = field(default_factory=dict)
    report: str = "power"
    voltage: float = 230.0
    breakers: dict[str, str] = field(default_factory=dict)
    """Each main's BreakerState (absent: Normal)."""
    power_states: dict[str, str] = field(default_factory=dict)
    """Each main's PowerState as set (absent: On); a breaker not Normal reads Off."""

    def breaker(self, main: str) -> str:
        """A main's BreakerState."""
        return self.breakers.get(main, "Normal")

    def power_state(self, main: str) -> str:
        """A main's PowerState as it reads: Off while its breaker is not Normal."""
        return "Off" if self.breaker(main) != "Normal" else self.power_states.get(main, "On")

    def carried_w(self, main: str) -> float:
        """What a main carries now: its power while it is Normal and On, else nothing."""
        return self.mains_w[main] if self.power_state(main) == "On" else 0.0


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
    pdu: _Pdu,
    path: str,
    cid: str,
    *,
    kind: str,
    power_w: float,
    energy: float,
    breaker: str = "Normal",
    power_state: str = "On",
) -> dict[str, Any]:
    sensors = path.rsplit("/", 2)[0] + "/Sensors"
    line_w = power_w / 3
    amps = line_w / pdu.voltage if pdu.voltage else 0.0
    doc: dict[str, Any] = {
        "@odata.id": path,
        "@odata.type": "#Circuit.v1_8_0.Circuit",
        "Id": cid,
        "Name": f"{kind} {cid}",
        "CircuitType": kind,
        "PhaseWiringType": "ThreePhase5Wire",
        "NominalVoltage": "AC400V",
        "RatedCurrentAmps": 32,
        "BreakerState": breaker,
        "PowerState": power_state,
        "Status": {"State": "Enabled", "Health": "Critical" if breaker == "Tripped" else "OK"},
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
        doc["CurrentAmps"]["Reading"] = power_w / pdu.voltage if pdu.voltage else 0.0
    return doc


def _build(name: str, pdu: _Pdu) -> dict[str, dict[str, Any]]:
    base = f"{_ROOT}/{name}"
    mains = list(pdu.mains_w)
    branches = {f"{m}{b}": m for m in mains for b in ("A", "B")}
    total_w = sum(pdu.carried_w(m) for m in mains)
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
    for main in mains:
        path = f"{base}/Mains/{main}"
        docs[path] = _circuit(
            pdu,
            path,
            main,
            kind="Mains",
            power_w=pdu.carried_w(main),
            energy=pdu.energy_kwh.get(main, 0.0),
            breaker=pdu.breaker(main),
            power_state=pdu.power_state(main),
        )
    for branch, main in branches.items():
        path = f"{base}/Branches/{branch}"
        energy = pdu.energy_kwh.get(main, 0.0) / 2
        docs[path] = _circuit(
            pdu,
            path,
            branch,
            kind="Branch",
            power_w=pdu.carried_w(main) / 2,
            energy=energy,
            power_state=pdu.power_state(main),
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
    if "breakers" in state:
        pdu.breakers.update(_per_main(pdu, name, state["breakers"], BREAKER_STATES))
    if "power_states" in state:
        pdu.power_states.update(_per_main(pdu, name, state["power_states"], POWER_STATES))
    docs.update(_build(name, pdu))


def _per_main(
    pdu: _Pdu, name: str, given: Mapping[str, Any], allowed: frozenset[str]
) -> dict[str, str]:
    """``given`` (main -> a state) checked against the PDU's mains and the schema's enum."""
    unknown = set(given) - set(pdu.mains_w)
    if unknown:
        msg = f"PDU {name} has no mains {sorted(unknown)}"
        raise ValueError(msg)
    wrong = {k: v for k, v in given.items() if v not in allowed}
    if wrong:
        msg = f"{wrong}: expected one of {sorted(allowed)}"
        raise ValueError(msg)
    return dict(given)
