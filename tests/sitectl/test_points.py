"""The site controller's points (``sitectl/points.py``): the tree of one step as
``power_domain``, ``power_feed`` and ``row_budget`` points, none from a standby; and the
shell writing them to a real InfluxDB after each step.

Driven through the core as ``test_core.py`` drives it (times passed in, the example's
tree: two rows on a UPS fed by A and B).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from polca.coord.leadership import Leadership
from polca.export.influx import make_sink
from polca.export.points import AnyPoint
from polca.export.schema import SCHEMA
from polca.sitectl.config import SiteSettings
from polca.sitectl.core import DomainLimit, SiteCore
from polca.sitectl.points import step_points
from polca.sitectl.runtime import SiteController
from polca.telemetry.schema import SourceState
from tests.export.test_influx import _until
from tests.sitectl.test_core import WALL, S, _core, _meter, _msg, _summary, _tree
from tests.tsdb import InfluxDB1Process


def _points(core: SiteCore, now_s: float = 1.0) -> list[AnyPoint]:
    step = core.step(now_s, now_ns=WALL, now_mono_ns=round(now_s * S))
    return list(
        step_points(step, core.tree, site="dc1", ts_ns=WALL + 7, leadership=core.leadership)
    )


def _by(points: list[AnyPoint], measurement: str, tag: str) -> dict[str, AnyPoint]:
    found = [p for p in points if p.measurement == measurement]
    by = {p.tags[tag]: p for p in found}
    assert len(by) == len(found), f"two {measurement} points for one {tag}"
    return by


def _w(point: AnyPoint, name: str) -> float:
    """A float field of ``point`` (fails the test when it is missing or of another type)."""
    value = point.fields[name]
    assert isinstance(value, float), (name, value)
    return value


def _check_schema(points: list[AnyPoint]) -> None:
    for point in points:
        schema = SCHEMA[point.measurement]
        assert set(point.tags) == set(schema.tags), point
        for name, value in point.fields.items():
            assert type(value) is schema.field_type(name), (point.measurement, name)


def test_a_step_of_the_whole_tree_is_one_point_per_domain_feed_and_row() -> None:
    """Every feed up at the start (nothing known yet): the design's capacity, no limit."""
    core = _core()
    core.receive(_msg("row1/summary", _summary("row1", high_w=300_000, low_w=50_000)), 1.0)
    points = _points(core)
    _check_schema(points)
    assert {p.ts_ns for p in points} == {WALL + 7}
    (ups,) = _by(points, "power_domain", "domain").values()
    assert ups.tags == {"site": "dc1", "domain": "ups-a", "kind": "ups"}
    assert ups.fields["capacity_w"] == ups.fields["unlimited_w"] == 600_000.0
    assert ups.fields["rating_w"] == 600_000.0
    assert ups.fields["measured_w"] == 370_000.0  # row1's summary; row2 has none yet
    assert (ups.fields["feeds_up"], ups.fields["feeds_down"]) == (2.0, 0.0)
    assert ups.fields["on_battery"] == 0.0
    assert "limit_w" not in ups.fields
    feeds = _by(points, "power_feed", "feed")
    assert {f: p.fields["up"] for f, p in feeds.items()} == {"A": 1.0, "B": 1.0}
    assert feeds["A"].fields["equipment"] == "unknown"
    assert feeds["A"].fields["rating_w"] == 600_000.0
    rows = _by(points, "row_budget", "row")
    assert rows["row1"].fields["measured_w"] == 370_000.0
    assert "measured_w" not in rows["row2"].fields
    assert rows["row2"].fields["stale"] == 1.0  # no summary within summary_max_age_s
    assert rows["row1"].fields["stale"] == 0.0
    for row in rows.values():
        assert row.fields["limited"] == 0.0
        assert "limited_by" not in row.fields
        assert row.fields["budget_w"] == row.fields["nominal_w"]
        assert row.fields["rating_w"] == 400_000.0


def test_a_feed_down_shows_in_its_domain_and_its_own_point() -> None:
    """Breaker B trips: power_feed B up 0 with what its equipment says, the UPS one feed
    down; then A's meter goes dark: A down too after its polls, and the rows cut."""
    core = _core()
    up, down = SourceState(equipment="up"), SourceState(equipment="down")
    core.receive(_msg("meters/meter", _meter({"ups-a-in": up})), 1.0)
    core.receive(_msg("row1/meter", _meter({"pdu-b": down})), 1.5)
    points = _points(core, 2.0)
    _check_schema(points)
    feeds = _by(points, "power_feed", "feed")
    assert (feeds["A"].fields["up"], feeds["A"].fields["equipment"]) == (1.0, "up")
    assert (feeds["B"].fields["up"], feeds["B"].fields["equipment"]) == (0.0, "down")
    assert feeds["B"].tags == {"site": "dc1", "domain": "ups-a", "feed": "B"}
    ups = _by(points, "power_domain", "domain")["ups-a"]
    assert (ups.fields["feeds_up"], ups.fields["feeds_down"]) == (1.0, 1.0)
    assert ups.fields["capacity_w"] == 600_000.0  # A alone carries the UPS
    dark = _meter({}, {"ups-a-in": "unreachable"})
    for i in range(3):
        core.receive(_msg("meters/meter", dark), 3.0 + i)
    points = _points(core, 6.0)
    feeds = _by(points, "power_feed", "feed")
    assert (feeds["A"].fields["up"], feeds["A"].fields["dark_polls"]) == (0.0, 3.0)
    ups = _by(points, "power_domain", "domain")["ups-a"]
    assert (ups.fields["feeds_up"], ups.fields["feeds_down"]) == (0.0, 2.0)
    assert ups.fields["capacity_w"] == 0.0
    for row in _by(points, "row_budget", "row").values():
        assert (row.fields["limited"], row.fields["limited_by"]) == (1.0, "ups-a")
        assert row.fields["budget_w"] == 0.0
        assert _w(row, "nominal_w") > 0.0


def test_a_limit_shows_as_limit_w_and_caps_the_capacity_not_the_unlimited_one() -> None:
    """An operator's limit: limit_w and the capacity at it, the unlimited capacity at the
    feeds'; the rows limited by the UPS; cleared, limit_w is left out again."""
    core = _core()
    core.set_limit("ups-a", DomainLimit(200_000, until_s=None, reason="UPS service", by="ops"))
    points = _points(core)
    ups = _by(points, "power_domain", "domain")["ups-a"]
    assert ups.fields["limit_w"] == 200_000.0
    assert ups.fields["capacity_w"] == 200_000.0
    assert ups.fields["unlimited_w"] == 600_000.0
    assert _w(ups, "budget_w") <= 200_000.0 + 1e-6
    rows = _by(points, "row_budget", "row")
    assert {r.fields["limited_by"] for r in rows.values()} == {"ups-a"}
    assert sum(_w(r, "budget_w") for r in rows.values()) <= 200_000.0 + 1e-6
    core.set_limit("ups-a", None)
    ups = _by(_points(core, 2.0), "power_domain", "domain")["ups-a"]
    assert "limit_w" not in ups.fields
    assert ups.fields["capacity_w"] == 600_000.0


def test_a_ups_on_battery_says_so() -> None:
    core = _core()
    battery = SourceState(equipment="up", on_battery=True, battery_minutes=12)
    core.receive(_msg("meters/meter", _meter({"ups-a-in": battery})), 1.0)
    ups = _by(_points(core), "power_domain", "domain")["ups-a"]
    assert ups.fields["on_battery"] == 1.0
    assert ups.fields["capacity_w"] == 300_000.0  # its battery rating


def test_a_standby_writes_no_point_and_a_leader_does() -> None:
    core = _core()
    core.leadership = Leadership.standby()
    assert _points(core) == []
    core.leadership.elected(term=3, instance="site-a", sent_mono_ns=S, ttl_s=2.0)
    assert {p.measurement for p in _points(core, 1.5)} == {
        "power_domain",
        "power_feed",
        "row_budget",
    }


async def test_the_shell_writes_each_steps_points_to_influxdb(
    influxdb1: InfluxDB1Process, tmp_path: Path
) -> None:
    """``SiteController.step`` hands the step's points to its sinks: a real InfluxDB 1.x
    holds the feed down, the UPS's feeds and the rows' budgets, each with its type."""
    settings = SiteSettings(
        site="dc1",
        instance="site-a",
        lease_s=30.0,
        state_dir=tmp_path,
        influx={"url": influxdb1.url, "api": "v1", "database": influxdb1.database,
                "flush_interval_s": 0.1},
    )  # fmt: skip
    sink = make_sink(settings.influx, state_dir=settings.state_dir)
    assert sink is not None
    controller = SiteController(settings, _tree(), sinks=[sink])
    down = _meter({"pdu-b": SourceState(equipment="down")})
    controller.handle_message(_msg("row1/meter", down))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(controller.sinks.run())
        controller.step()
        await _until(lambda: controller.sinks.stats.points_written >= 5)
        await controller.sinks.close(timeout_s=5.0)
    assert controller.sinks.stats.points_written == 5  # 1 domain, 2 feeds, 2 rows
    feeds = influxdb1.query(
        'SELECT "up", "equipment", "rating_w" FROM "power_feed" GROUP BY "feed"'
    )
    by_feed = {s["tags"]["feed"]: s["values"][0][1:] for s in feeds}
    assert by_feed == {"A": [1.0, "unknown", 600_000.0], "B": [0.0, "down", 600_000.0]}
    (ups,) = influxdb1.query('SELECT "feeds_down", "capacity_w" FROM "power_domain"')
    assert ups["values"][0][1:] == [1.0, 600_000.0]
    rows = influxdb1.query('SELECT "budget_w", "limited" FROM "row_budget" GROUP BY "row"')
    assert {s["tags"]["row"] for s in rows} == {"row1", "row2"}
    assert all(s["values"][0][2] == 0.0 for s in rows)
