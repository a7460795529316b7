"""The coolant of the simulated plant, and the heat a flow of it carries.

Why a module of its own: the plant model (``model.py``), the CDU's own heat figure
(``cdu.py``), the ratings' loop heat capacity (``ratings.py``) and the tests' heat
balances must all use the same constants; a supervisor checking the plant's heat balance
must use them too (``cooling/loops.py`` takes them as loop settings, with these defaults).

The coolant is water (DI water with inhibitor). PG25 would be cp ~3.8 kJ/(kg K) and rho
~1.02 kg/L. Pure arithmetic: no state, no I/O.
"""

from __future__ import annotations

__all__ = [
    "COOLANT_CP_KJ_PER_KG_K",
    "COOLANT_DENSITY_KG_PER_L",
    "heat_flow_kw",
    "mass_flow_kg_s",
]

COOLANT_CP_KJ_PER_KG_K = 4.18
COOLANT_DENSITY_KG_PER_L = 0.996  # water at about 30 C


def mass_flow_kg_s(flow_lpm: float) -> float:
    """Coolant mass flow in kg/s for a volume flow in L/min."""
    return flow_lpm * COOLANT_DENSITY_KG_PER_L / 60.0


def heat_flow_kw(flow_lpm: float, delta_t_c: float) -> float:
    """Heat carried by ``flow_lpm`` of coolant warmed by ``delta_t_c``: m x cp x dT, in kW."""
    return mass_flow_kg_s(flow_lpm) * COOLANT_CP_KJ_PER_KG_K * delta_t_c
