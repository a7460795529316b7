"""What one simulated CDU and its loop are rated for: ``CduRatings``.

The plant model (``model.py``) is sized from these ratings, ``SimulatedCdu``
(``cdu.py``) takes them, and the demo and ``polca cdu simulate`` build them from their
options. Validation happens here, once, so that the model can trust every field.
"""

from __future__ import annotations

from dataclasses import dataclass

from polca.plant.coolant import COOLANT_CP_KJ_PER_KG_K, COOLANT_DENSITY_KG_PER_L

__all__ = ["CduRatings"]


@dataclass(frozen=True, slots=True)
class CduRatings:
    """What one CDU and its loop are rated for (the defaults: a 100 kW in-row CDU).

    ``heat_capacity_kw`` is the heat it removes at the design flow with the design facility
    water and a clean exchanger, ``hx_approach_c`` the exchanger's approach (secondary
    supply minus facility supply) at that load; together they give its UA.
    """

    heat_capacity_kw: float = 100.0
    design_flow_lpm: float = 150.0  # ~1.5 L/min per kW (OCP guidance at a 10 K rise)
    supply_setpoint_c: float = 30.0
    supply_min_c: float = 20.0
    supply_max_c: float = 35.0
    max_delta_t_c: float = 12.0
    pump_count: int = 2
    pump_redundancy: int = 1  # N+1: one pump on standby
    capture_fraction: float = 0.8  # share of rack power taken by the liquid
    design_delta_pressure_kpa: float = 150.0  # pump head at the design flow
    facility_supply_c: float = 22.0  # design facility water supply (ASHRAE W27 class)
    hx_approach_c: float = 4.0
    failover_delay_s: float = 2.0
    loop_volume_l: float = 60.0  # coolant on the rack side: the loop's thermal mass
    leak_detectors: int = 2

    def __post_init__(self) -> None:
        """Reject ratings the model cannot run with, naming the field."""
        positive = (
            "heat_capacity_kw",
            "design_flow_lpm",
            "max_delta_t_c",
            "design_delta_pressure_kpa",
            "hx_approach_c",
            "loop_volume_l",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                msg = f"CDU rating {name} must be > 0, got {getattr(self, name)}"
                raise ValueError(msg)
        if not self.supply_min_c < self.supply_setpoint_c < self.supply_max_c:
            msg = (
                f"CDU supply limits must bracket the setpoint: {self.supply_min_c} < "
                f"{self.supply_setpoint_c} < {self.supply_max_c} does not hold"
            )
            raise ValueError(msg)
        if not 1 <= self.pump_count <= 16 or not 0 <= self.pump_redundancy < self.pump_count:
            msg = (
                f"CDU needs 1-16 pumps and fewer standby than pumps: pump_count "
                f"{self.pump_count}, pump_redundancy {self.pump_redundancy}"
            )
            raise ValueError(msg)
        if not 0 < self.capture_fraction <= 1:
            msg = f"capture_fraction must be in (0, 1], got {self.capture_fraction}"
            raise ValueError(msg)
        if self.failover_delay_s < 0 or not 0 <= self.leak_detectors <= 64:
            msg = (
                f"failover_delay_s must be >= 0 and leak_detectors 0-64: "
                f"{self.failover_delay_s}, {self.leak_detectors}"
            )
            raise ValueError(msg)

    @property
    def pumps_required(self) -> int:
        """Pumps that must run to deliver the design flow (N of N + redundancy)."""
        return self.pump_count - self.pump_redundancy

    @property
    def ua_kw_per_k(self) -> float:
        """The clean exchanger's UA: rated heat over the rated approach."""
        return self.heat_capacity_kw / self.hx_approach_c

    @property
    def loop_heat_capacity_kj_per_k(self) -> float:
        """Thermal mass of the rack-side coolant."""
        return self.loop_volume_l * COOLANT_DENSITY_KG_PER_L * COOLANT_CP_KJ_PER_KG_K
