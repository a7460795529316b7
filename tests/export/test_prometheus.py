"""The Prometheus sink: families, units, labels, the series bound and staleness."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polca.aggregator import points
from polca.export.points import make_point
from polca.export.prometheus import PrometheusSink
from polca.gpu.backend import CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN, CLOCK_EVENT_SW_POWER_CAP
from polca.telemetry.schema import Telemetry
from tests.export.test_points import TS_NS, _gpu
from tests.export.test_points import _telemetry as telemetry_of


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _scrape(sink: PrometheusSink) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(sink.registry).decode()
    return {
        sample.name: [
            *(
                (s.labels, s.value)
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == sample.name
            )
        ]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _telemetry(**gpu: object) -> Telemetry:
    return telemetry_of((_gpu(0, **gpu),))


def test_gpu_points_become_base_unit_families_with_prometheus_labels() -> None:
    """Watts, joules (a counter), hertz, ratios; gpu/uuid/class labels; reasons one by one."""
    sink = PrometheusSink("127.0.0.1:0", clock=_Clock())
    mask = CLOCK_EVENT_SW_POWER_CAP | CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
    telemetry = _telemetry(
        power_mean_w=412.5, sm_clock_mhz=1410, gpu_util_pct=75.0, clock_event_reasons=mask
    )
    sink.write(points.gpu_points(telemetry, site="s1", row="row1", rack="rack1"))
    metrics = _scrape(sink)
    ((labels, watts),) = metrics["polca_gpu_power_watts"]
    assert watts == 412.5
    assert labels["gpu"] == "0"
    assert labels["uuid"].startswith("GPU-")
    assert (labels["site"], labels["row"], labels["rack"], labels["node"]) == (
        "s1",
        "row1",
        "rack1",
        "n01",
    )
    assert "class" in labels
    assert "model" not in labels
    assert metrics["polca_gpu_sm_clock_hertz"][0][1] == 1410e6
    assert metrics["polca_gpu_utilization_ratio"][0][1] == 0.75
    assert "polca_gpu_energy_joules_total" in metrics
    active = {labels["reason"]: value for labels, value in metrics["polca_gpu_clock_event_active"]}
    assert active["sw_power_cap"] == 1.0
    assert active["hw_power_brake_slowdown"] == 1.0
    assert active["hw_thermal_slowdown"] == 0.0


def test_row_and_aggregator_points_and_drops_by_reason() -> None:
    """Row power against budget and level; intake drops with one series per reason."""
    sink = PrometheusSink("127.0.0.1:0", clock=_Clock())
    row = make_point(
        "row",
        ts_ns=TS_NS,
        tags={"site": "s1", "row": "row1"},
        fields={"power_w": 9100.0, "budget_w": 10000.0, "level": 2.0, "threshold_2_w": 8900.0},
    )
    health = points.aggregator_point(
        ts_ns=TS_NS,
        site="s1",
        instance="agg1",
        messages_in=50,
        dropped={"malformed": 3, "oversized": 1},
    )
    sink.write([row, health])
    metrics = _scrape(sink)
    assert metrics["polca_row_power_watts"] == [({"site": "s1", "row": "row1"}, 9100.0)]
    assert metrics["polca_row_level"][0][1] == 2.0
    assert metrics["polca_row_threshold_2_watts"][0][1] == 8900.0
    assert metrics["polca_aggregator_messages_total"] == [({"site": "s1"}, 50.0)]
    dropped = {
        labels["reason"]: value
        for labels, value in metrics["polca_aggregator_messages_dropped_total"]
    }
    assert dropped == {"malformed": 3.0, "oversized": 1.0}


def test_series_are_bounded_and_a_quiet_series_is_left_out() -> None:
    """New series beyond the bound are refused and counted; old ones go stale, not frozen."""
    clock = _Clock()
    sink = PrometheusSink("127.0.0.1:0", max_series=3, stale_after_s=60, clock=clock)
    for i in range(10):
        sink.write(
            [
                make_point(
                    "rack",
                    ts_ns=TS_NS,
                    tags={"site": "s", "row": "r", "rack": f"k{i}"},
                    fields={"power_w": float(i)},
                )
            ]
        )
    assert len(_scrape(sink)["polca_rack_power_watts"]) == 3
    assert sink.stats.dropped == {"series_limit": 7}
    clock.now_s += 61
    assert "polca_rack_power_watts" not in _scrape(sink)


def test_every_family_is_documented() -> None:
    """docs/prometheus.md names every metric family the sink can serve."""
    from pathlib import Path

    from polca.export.prometheus import CLOCK_EVENT_FAMILY, DROPPED_FAMILY, FAMILIES

    text = (Path(__file__).resolve().parents[2] / "docs" / "prometheus.md").read_text(
        encoding="utf-8"
    )
    for name in [*(f.name for f in FAMILIES), CLOCK_EVENT_FAMILY, DROPPED_FAMILY]:
        assert f"`{name}`" in text, name
