"""GPU health on the agent: what goes on the wire when, new XIDs, and the simulated GPUs."""

from __future__ import annotations

from polca.agent.gpu_health import HealthTracker, report
from polca.errors import GpuLostError
from polca.gpu.backend import GpuHealth
from polca.gpu.simulated import SimulatedBackend


def _health(index: int = 0, **counters: int | None) -> GpuHealth:
    base: dict[str, int | None] = {"xid_errors": 0, "ecc_corrected_volatile": 0}
    base.update(counters)
    return GpuHealth(index=index, uuid=f"GPU-{index}", **base)


def test_counters_go_out_on_change_and_every_period() -> None:
    """First reading: sent; unchanged: not until every_s passed; changed: at once."""
    tracker = HealthTracker(every_s=30)
    tracker.note({0: _health(0), 1: _health(1)})
    assert set(tracker.due(0.0)) == {0, 1}
    assert tracker.due(1.0) == {}
    tracker.note({0: _health(0, ecc_corrected_volatile=3), 1: _health(1)})
    due = tracker.due(2.0)
    assert list(due) == [0]
    assert due[0].ecc_corrected_volatile == 3
    assert tracker.due(29.0) == {}
    assert set(tracker.due(30.0)) == {1}  # GPU 1 last went out at 0 s
    assert set(tracker.due(32.0)) == {0}


def test_new_xids_are_reported_once_and_a_failed_read_keeps_the_last() -> None:
    """A rising XID count comes back as new events; a GPU that failed keeps its counters."""
    tracker = HealthTracker(every_s=30)
    assert tracker.note({0: _health(0)}) == []
    (xid,) = tracker.note({0: _health(0, xid_errors=2, last_xid=79)})
    assert (xid.index, xid.count, xid.last_xid) == (0, 2, 79)
    assert tracker.note({0: _health(0, xid_errors=2, last_xid=79)}) == []
    lost = GpuLostError("gone", index=0)
    assert tracker.note({0: lost}) == []
    assert tracker.latest[0].xid_errors == 2


def test_out_of_bounds_counters_are_not_sent() -> None:
    """A counter the wire refuses (beyond int64) is counted and the reading skipped."""
    tracker = HealthTracker(every_s=30)
    tracker.note({0: _health(0, pcie_replays=2**64)})
    assert tracker.invalid == 1
    assert tracker.due(0.0) == {}


def test_report_converts_throttle_time_to_seconds() -> None:
    """ns from NVML, seconds on the wire; None stays None."""
    wire = report(_health(0, power_brake_ns=2_500_000_000, sw_thermal_slowdown_ns=None))
    assert wire.power_brake_s == 2.5
    assert wire.sw_thermal_slowdown_s is None


def test_simulated_gpus_count_brake_time_and_injected_errors() -> None:
    """Brake time integrates while the brake holds; XIDs and ECC errors by injection."""
    now = [0.0]
    backend = SimulatedBackend(count=2, load="constant:0.8", clock=lambda: now[0])
    backend.discover()
    assert backend.health(0).power_brake_ns == 0
    backend.set_power_brake(0, engaged=True)
    now[0] = 2.0
    backend.set_power_brake(0, engaged=False)
    now[0] = 3.0
    brake_s = (backend.health(0).power_brake_ns or 0) / 1e9
    assert 1.9 <= brake_s <= 2.1
    assert backend.health(1).power_brake_ns == 0
    backend.inject_xid(1, 48)
    backend.inject_ecc_errors(1, uncorrected=2)
    h = backend.health(1)
    assert (h.xid_errors, h.last_xid, h.ecc_uncorrected_volatile) == (1, 48, 2)
