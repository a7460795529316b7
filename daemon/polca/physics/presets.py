"""Presets of the GPUs the simulated backend and the row simulator can pretend to be.

Both simulators (``polca.gpu.simulated``, one node; ``polca.sim``, a whole row) need the
electrical, clock and thermal envelope of a GPU; real GPUs report most of it through NVML,
so these presets exist only for simulation and capacity planning. They are data, not
behaviour: how power moves with clock and utilization is ``polca.physics.power``, the
thermal model and NVML's behaviour are the backend's (``polca.gpu.simulated``).

Sources and confidence (see ``/work/shared/reference/polca-paper.md`` §4 and ``peers.md``):

- Power limits: A100 SXM4 400 W TDP and default limit, H100 SXM 700 W with the DGX range
  200-700 W (DGX B200 user guide, Redfish example in polca-paper.md §4.1). The A100 minimum
  of 100 W is the value ``nvidia-smi -q -d POWER`` commonly reports for A100 SXM4 [U].
- Clocks: A100 boost 1410 MHz, H100/H200 boost 1980 MHz; supported SM clocks in 15 MHz steps
  from 210 MHz (A100) and 345 MHz (H100/H200), as listed by ``nvidia-smi -q -d SUPPORTED_CLOCKS``
  on those parts [U]. The POLCA clock points 1305/1275/1110 MHz lie on the A100 grid.
- Memory clocks: 1593 MHz (A100 HBM2e), 2619 MHz (H100 HBM3), 3201 MHz (H200 HBM3e) [U].
- Idle power: A100 ~55 W and H100 ~70 W without a context (polca-paper.md §4.1 gives
  72.5 W for H100); H200 a little higher for its larger HBM3e stack [U].
- Temperatures: slowdown 89 °C, shutdown 92 °C, HBM max 95 °C as ``nvidia-smi -q -d
  TEMPERATURE`` reports on A100/H100 SXM (polca-paper.md §4.3 gives ~89-90 and ~92-95) [U].
- Thermal resistance and time constant are modelling assumptions [U], chosen so that a
  fully loaded GPU settles about 35-40 °C above its coolant (air inlet for the air-cooled
  A100 boards, cold-plate water for H100/H200) within about a minute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class GpuModel:
    """The static envelope of one GPU type, as the simulator uses it."""

    name: str  # preset key, e.g. "H100-SXM"
    product_name: str  # what NVML's nvmlDeviceGetName would return
    memory_gb: int
    tdp_w: float  # thermal design power, also the default power limit
    power_limit_min_w: float
    power_limit_max_w: float
    idle_power_w: float  # no work, lowest clocks
    # Power drawn at 100 % utilization and maximum SM clock without any limiter; a little
    # above TDP so that full load runs into the power cap, as real parts do [U].
    max_demand_power_w: float
    # Share of the dynamic power spent in memory, which an SM clock lock does not reduce.
    mem_power_share: float
    # Exponent of the SM clock ratio in the dynamic power (f * V^2 with V rising with f).
    clock_power_exponent: float
    sm_clock_min_mhz: int
    sm_clock_max_mhz: int
    sm_clock_step_mhz: int
    mem_clock_mhz: int
    thermal_resistance_c_per_w: float  # GPU die to coolant (or inlet air), steady state
    thermal_time_constant_s: float  # first-order response of die plus heat sink
    mem_temp_offset_c: float  # HBM runs this much hotter than the die at full utilization
    slowdown_temp_c: float  # software thermal slowdown starts here (reason 0x20)
    shutdown_temp_c: float  # hardware thermal slowdown / shutdown (reason 0x40)
    mem_max_temp_c: float

    @property
    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """The SM clocks a lock call accepts, highest first (NVML's order)."""
        return tuple(
            range(self.sm_clock_max_mhz, self.sm_clock_min_mhz - 1, -self.sm_clock_step_mhz)
        )

    @property
    def tdp_mw(self) -> int:
        """TDP (and default power limit) in milliwatts."""
        return round(self.tdp_w * 1000)


_A100_80GB = GpuModel(
    name="A100-SXM4",
    product_name="NVIDIA A100-SXM4-80GB",
    memory_gb=80,
    tdp_w=400.0,
    power_limit_min_w=100.0,
    power_limit_max_w=400.0,
    idle_power_w=55.0,
    max_demand_power_w=430.0,
    mem_power_share=0.15,
    clock_power_exponent=2.5,
    sm_clock_min_mhz=210,
    sm_clock_max_mhz=1410,
    sm_clock_step_mhz=15,
    mem_clock_mhz=1593,
    # Air-cooled DGX A100: ~36 °C over inlet at 400 W.
    thermal_resistance_c_per_w=0.09,
    thermal_time_constant_s=25.0,
    mem_temp_offset_c=8.0,
    slowdown_temp_c=89.0,
    shutdown_temp_c=92.0,
    mem_max_temp_c=95.0,
)

_H100 = GpuModel(
    name="H100-SXM",
    product_name="NVIDIA H100 80GB HBM3",
    memory_gb=80,
    tdp_w=700.0,
    power_limit_min_w=200.0,
    power_limit_max_w=700.0,
    idle_power_w=70.0,
    # H100 averages 696 W at its 700 W limit under HPL (polca-paper.md §4.1): demand above.
    max_demand_power_w=750.0,
    mem_power_share=0.15,
    clock_power_exponent=2.5,
    sm_clock_min_mhz=345,
    sm_clock_max_mhz=1980,
    sm_clock_step_mhz=15,
    mem_clock_mhz=2619,
    # Cold plate: ~38 °C over coolant at 700 W.
    thermal_resistance_c_per_w=0.055,
    thermal_time_constant_s=20.0,
    mem_temp_offset_c=10.0,
    slowdown_temp_c=89.0,
    shutdown_temp_c=92.0,
    mem_max_temp_c=95.0,
)

_MODELS: dict[str, GpuModel] = {
    m.name.lower(): m
    for m in (
        _A100_80GB,  # "A100-SXM4" names the 80 GB part
        replace(
            _A100_80GB,
            name="A100-SXM4-40GB",
            product_name="NVIDIA A100-SXM4-40GB",
            memory_gb=40,
            idle_power_w=52.0,  # half the HBM, a little less idle power [U]
        ),
        _H100,
        replace(
            _H100,
            name="H200-SXM",
            product_name="NVIDIA H200",
            memory_gb=141,
            idle_power_w=78.0,
            mem_power_share=0.2,  # six HBM3e stacks at a higher clock draw more [U]
            mem_clock_mhz=3201,
            mem_temp_offset_c=11.0,
        ),
    )
}

MODEL_NAMES: tuple[str, ...] = tuple(m.name for m in _MODELS.values())


def get_model(name: str) -> GpuModel:
    """Return the preset called ``name`` (case-insensitive).

    Raises ``ValueError`` naming the known presets, so a settings validator can call it.
    """
    try:
        return _MODELS[name.strip().lower()]
    except KeyError as exc:
        msg = f"unknown GPU model {name!r}; known models: {', '.join(MODEL_NAMES)}"
        raise ValueError(msg) from exc


__all__ = ["MODEL_NAMES", "GpuModel", "get_model"]
