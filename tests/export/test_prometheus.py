"""The Prometheus sink: families, units, labels, the series bound and staleness."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polca.aggregator import points
from polca.export import gpus
from polca.export.points import AnyPoint, make_point
from polca.export.prometheus import PrometheusSink
from polca.gpu.backend import CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN, CLOCK_EVENT_SW_POWER_CAP
from polca.sitectl.core import DomainLimit
from polca.telemetry.schema import GpuHealthReport, SourceState, Telemetry
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
    sink.write(gpus.gpu_points(telemetry, site="s1", row="row1", rack="rack1"))
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
        control_step_failures=2,
        dropped={"malformed": 3, "oversized": 1, "rate_limited": 7},
        implausible={"power": 5, "gpu_list": 1},
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
    assert dropped == {"malformed": 3.0, "oversized": 1.0, "rate_limited": 7.0}
    implausible = {
        labels["reason"]: value
        for labels, value in metrics["polca_aggregator_implausible_telemetry_total"]
    }
    assert implausible == {"power": 5.0, "gpu_list": 1.0}
    assert metrics["polca_aggregator_control_step_failures_total"] == [({"site": "s1"}, 2.0)]


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

    from polca.export.prometheus import (
        BUDGET_ORIGIN_FAMILY,
        CLOCK_EVENT_FAMILY,
        DROPPED_FAMILY,
        FAMILIES,
        IMPLAUSIBLE_FAMILY,
    )

    text = (Path(__file__).resolve().parents[2] / "docs" / "prometheus.md").read_text(
        encoding="utf-8"
    )
    for name in [
        *(f.name for f in FAMILIES),
        CLOCK_EVENT_FAMILY,
        DROPPED_FAMILY,
        IMPLAUSIBLE_FAMILY,
        BUDGET_ORIGIN_FAMILY,
    ]:
        assert f"`{name}`" in text, name


def test_series_without_a_tag_keep_their_labels_apart() -> None:
    """A GPU without a class and one with a class: each value keeps its own labels."""
    sink = PrometheusSink("127.0.0.1:0", clock=_Clock())
    telemetry = telemetry_of(
        (_gpu(0, power_mean_w=100.0, priority_class=None), _gpu(1, power_mean_w=200.0))
    )
    sink.write(gpus.gpu_points(telemetry, site="s1", row="row1", rack="rack1"))
    by_gpu = {labels["gpu"]: (labels, v) for labels, v in _scrape(sink)["polca_gpu_power_watts"]}
    assert by_gpu["0"][1] == 100.0
    assert by_gpu["1"][1] == 200.0
    assert by_gpu["0"][0]["node"] == by_gpu["1"][0]["node"]
    assert "class" not in by_gpu["0"][0] or by_gpu["0"][0]["class"] == ""


def test_a_snapshot_measurement_replaces_its_series() -> None:
    """gpu_cap is written whole: a cap whose reason changed leaves no series behind."""
    sink = PrometheusSink("127.0.0.1:0", clock=_Clock(), snapshots=frozenset({"gpu_cap"}))

    def cap(reason: str, mhz: float) -> list[AnyPoint]:
        tags = {
            "site": "s",
            "row": "r",
            "rack": "k",
            "node": "n",
            "gpu_uuid": "GPU-1",
            "gpu_index": "0",
            "class": "low",
            "clock_reason": reason,
            "power_reason": "none",
        }
        fields = {"sm_clock_max_mhz": mhz, "applied": 1.0}
        return [make_point("gpu_cap", ts_ns=TS_NS, tags=tags, fields=fields)]

    sink.write(cap("level:T1", 1275))
    sink.write(cap("level:T2", 1110))
    ((labels, hertz),) = _scrape(sink)["polca_gpu_cap_sm_clock_hertz"]
    assert (labels["clock_reason"], hertz) == ("level:T2", 1110e6)


def test_health_counters_become_labelled_families() -> None:
    """ECC counts by type and counter, throttle seconds by reason, the last XID."""
    sink = PrometheusSink("127.0.0.1:0", clock=_Clock())
    health = GpuHealthReport(
        xid_errors=2,
        last_xid=48,
        ecc_corrected_volatile=5,
        ecc_uncorrected_volatile=1,
        ecc_corrected_aggregate=50,
        ecc_uncorrected_aggregate=3,
        power_brake_s=1.5,
    )
    telemetry = telemetry_of((_gpu(0, health=health), _gpu(1)))
    sink.write(gpus.gpu_health_points(telemetry, site="s1", row="row1", rack="rack1"))
    metrics = _scrape(sink)
    assert [v for _, v in metrics["polca_gpu_xid_errors_total"]] == [2.0]  # GPU 0 only
    assert [v for _, v in metrics["polca_gpu_last_xid"]] == [48.0]
    ecc = {(lb["type"], lb["counter"]): v for lb, v in metrics["polca_gpu_ecc_errors_total"]}
    assert ecc == {
        ("corrected", "volatile"): 5.0,
        ("uncorrected", "volatile"): 1.0,
        ("corrected", "aggregate"): 50.0,
        ("uncorrected", "aggregate"): 3.0,
    }
    ((labels, seconds),) = metrics["polca_gpu_throttle_seconds_total"]
    assert (labels["reason"], seconds) == ("hw_power_brake_slowdown", 1.5)
    assert "polca_gpu_pcie_replays_total" not in metrics  # unsupported: absent, not zero


def test_out_of_band_writes_become_per_node_counters_and_gauges() -> None:
    """An ``oob`` point (a write through a node's BMC) shows as the node's counters of
    caps, releases and failures, whether it is capped, and the limit read back."""
    from polca.bmc.actuator import OobOutcome

    sink = PrometheusSink("127.0.0.1:0", clock=_Clock())
    outcome = OobOutcome(
        node="n7",
        action="cap",
        target_w=3000.0,
        limit_w=3000.0,
        verified=True,
        error=None,
        reason="agent offline at level 2",
        latency_s=0.4,
    )
    counts = {"caps": 2, "failures": 1}
    sink.write([points.oob_point(outcome, ts_ns=TS_NS, site="dc1", capped=True, counts=counts)])
    scraped = _scrape(sink)
    labels = {"site": "dc1", "node": "n7"}
    assert scraped["polca_oob_caps_total"] == [(labels, 2.0)]
    assert scraped["polca_oob_releases_total"] == [(labels, 0.0)]
    assert scraped["polca_oob_failures_total"] == [(labels, 1.0)]
    assert scraped["polca_oob_capped"] == [(labels, 1.0)]
    assert scraped["polca_oob_limit_watts"] == [(labels, 3000.0)]


def test_a_gpus_class_origin_and_workload_become_an_info_series() -> None:
    """``gpu_workload``: 1 per GPU with a runtime class, labelled with where the class came
    from and the namespace, pod and container holding it; none for a GPU without one."""
    from polca.export.gpus import gpu_workload_points
    from polca.telemetry.schema import WorkloadRef

    message = telemetry_of((_gpu(0), _gpu(1)))
    first, *others = message.gpus
    held = first.model_copy(
        update={
            "priority_class": "high",
            "class_origin": "annotation",
            "workload": WorkloadRef(namespace="serving", pod="llm-0", container="server"),
        }
    )
    message = message.model_copy(update={"gpus": (held, *others)})
    sink = PrometheusSink("127.0.0.1:0", clock=_Clock())
    sink.write(gpu_workload_points(message, site="dc1", row="row1", rack="rack1"))
    [(labels, value)] = _scrape(sink)["polca_gpu_workload_info"]
    assert value == 1.0
    assert labels["class"] == "high"
    assert labels["class_origin"] == "annotation"
    assert (labels["namespace"], labels["pod"], labels["container"]) == (
        "serving",
        "llm-0",
        "server",
    )


def test_the_power_tree_becomes_its_families_and_a_cleared_limit_goes_at_once() -> None:
    """The site controller's points: each domain's capacity, budget and power in watts, a
    feed down as 0, the rows' leased budgets; written whole (snapshots), so a limit that
    is no longer written leaves no series behind."""
    from polca.sitectl.points import TREE_MEASUREMENTS
    from tests.sitectl.test_core import _core, _meter, _msg
    from tests.sitectl.test_points import _points

    sink = PrometheusSink("127.0.0.1:0", clock=_Clock(), snapshots=TREE_MEASUREMENTS)
    core = _core()
    core.set_limit("ups-a", DomainLimit(200_000, until_s=None, reason="service", by="ops"))
    core.receive(_msg("row1/meter", _meter({"pdu-b": SourceState(equipment="down")})), 1.0)
    sink.write(_points(core, 1.0))
    metrics = _scrape(sink)
    ups = {"site": "dc1", "domain": "ups-a", "kind": "ups"}
    assert metrics["polca_power_domain_capacity_watts"] == [(ups, 200_000.0)]
    assert metrics["polca_power_domain_unlimited_capacity_watts"] == [(ups, 600_000.0)]
    assert metrics["polca_power_domain_limit_watts"] == [(ups, 200_000.0)]
    assert metrics["polca_power_domain_rating_watts"] == [(ups, 600_000.0)]
    assert metrics["polca_power_domain_feeds_down"] == [(ups, 1.0)]
    up = {labels["feed"]: value for labels, value in metrics["polca_power_feed_up"]}
    assert up == {"A": 1.0, "B": 0.0}
    limited = {labels["row"]: v for labels, v in metrics["polca_power_row_limited"]}
    assert limited == {"row1": 1.0, "row2": 1.0}
    assert {labels["row"] for labels, _ in metrics["polca_power_row_budget_watts"]} == {
        "row1",
        "row2",
    }
    core.set_limit("ups-a", None)
    sink.write(_points(core, 2.0))
    metrics = _scrape(sink)
    assert "polca_power_domain_limit_watts" not in metrics
    assert metrics["polca_power_domain_capacity_watts"] == [(ups, 600_000.0)]


def test_the_rows_budget_origin_is_one_series_per_origin() -> None:
    """``row.budget_origin`` (a string) as 1 for the origin in force and 0 for the others;
    the electrical and leased budgets and ``on_fallback`` as gauges."""
    sink = PrometheusSink("127.0.0.1:0", clock=_Clock())

    def row(origin: str, **fields: float) -> list[AnyPoint]:
        values: dict[str, object] = {"budget_origin": origin, **fields}
        tags = {"site": "s1", "row": "row1"}
        return [make_point("row", ts_ns=TS_NS, tags=tags, fields=values)]  # type: ignore[arg-type]

    sink.write(row("fallback", electrical_budget_w=6000.0, on_fallback=1.0))
    metrics = _scrape(sink)
    origins = {labels["origin"]: v for labels, v in metrics["polca_row_budget_origin"]}
    assert origins == {"config": 0.0, "lease": 0.0, "fallback": 1.0, "feeds": 0.0}
    assert metrics["polca_row_on_fallback"] == [({"site": "s1", "row": "row1"}, 1.0)]
    assert metrics["polca_row_electrical_budget_watts"][0][1] == 6000.0
    sink.write(row("lease", electrical_budget_w=8000.0, leased_budget_w=8000.0, on_fallback=0.0))
    metrics = _scrape(sink)
    origins = {labels["origin"]: v for labels, v in metrics["polca_row_budget_origin"]}
    assert origins == {"config": 0.0, "lease": 1.0, "fallback": 0.0, "feeds": 0.0}
    assert metrics["polca_row_leased_budget_watts"][0][1] == 8000.0


def test_every_measurement_but_the_audit_ones_has_families() -> None:
    """A new measurement needs its families (or a reason to have none, named here)."""
    from polca.export.prometheus import FAMILIES
    from polca.export.schema import SCHEMA

    # Text for annotations and tables (events, alarms, who led): no number to serve.
    audit = {"event", "cooling_alarm", "leadership"}
    assert set(SCHEMA) - {f.measurement for f in FAMILIES} == audit
    for family in FAMILIES:
        assert SCHEMA[family.measurement].field_type(family.field) in (float, int), family
