"""Grafana provisioning for polca's InfluxDB data: structure, and every query against real data.

The dashboards in ``deploy/grafana/`` are JSON that no linter understands: a renamed field, a
typo in a tag or a Flux-only construct would only show as an empty panel in front of an
operator. So these tests check the provisioning's structure, then write a simulated run of
one row (two racks, three 8-GPU nodes, 120 s at 1 s, level changes, events, drops), of
two liquid-cooling loops (a pump failure, a stale CDU, a leak, their alarms) and of the
power tree above the row (a tripped feed, a UPS on battery, a dark meter, an operator's
limit, a lost site controller, the row on its fallback) into a real
InfluxDB 1.x, and run every panel target, annotation and template variable query the
way Grafana would (macros and variables substituted), expecting each selected column to
carry data. ``test_checker_reports_*`` prove that the checker fails on a broken query.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from polca.aggregator import points
from polca.coord.leadership import Leadership
from polca.powertree.allocate import RowDemand, allocate
from polca.powertree.capacity import FeedState, SiteState
from polca.powertree.model import build_tree
from polca.sitectl import points as site_points
from polca.sitectl.core import SiteStep
from tests.tsdb import InfluxDB1Process

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DATASOURCES_YAML = GRAFANA / "provisioning" / "datasources" / "polca.yaml"
PROVIDERS_YAML = GRAFANA / "provisioning" / "dashboards" / "polca.yaml"
DASHBOARD_DIR = GRAFANA / "dashboards"
README = GRAFANA / "README.md"

TIME_FILTER = "time >= now() - 1h"
INTERVAL = "10s"
GRID_COLUMNS = 24
_VARIABLE_RE = re.compile(r"\$\{?(\w+)\}?")
_REGEX_VARIABLE_RE = re.compile(r"/\^\$(\w+)\$/")
_LEFTOVER_RE = re.compile(r"\$\{?[A-Za-z_]")  # a macro or variable; not a regex's end anchor

# --- the provisioning files -------------------------------------------------------------------


def _yaml(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return loaded


def _dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard JSON file, by file name."""
    return {
        path.name: json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(DASHBOARD_DIR.glob("*.json"))
    }


def _panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """All panels, including those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def _provisioned_uids() -> set[str]:
    return {source["uid"] for source in _yaml(DATASOURCES_YAML)["datasources"]}


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    """One InfluxQL text from a dashboard, named by where it sits."""

    where: str
    text: str


def _panel_queries(name: str, dashboard: Mapping[str, Any]) -> list[Query]:
    return [
        Query(f"{name} panel {panel['title']!r} target {target['refId']}", target["query"])
        for panel in _panels(dashboard)
        if panel.get("type") != "row"
        for target in panel.get("targets", [])
    ]


def _annotation_queries(name: str, dashboard: Mapping[str, Any]) -> list[Query]:
    return [
        Query(f"{name} annotation {annotation['name']!r}", annotation["target"]["query"])
        for annotation in dashboard["annotations"]["list"]
        if not annotation.get("builtIn")
    ]


def test_all_selections_stay_short_and_queries_go_by_post() -> None:
    """An "All" selection sends ``.*``, not every node name of a large row; and the
    datasource POSTs its queries, so a long selection never overflows a URL."""
    for name, board in _dashboards().items():
        for variable in board["templating"]["list"]:
            if variable.get("includeAll"):
                assert variable.get("allValue") == ".*", (name, variable["name"])
    (source,) = _yaml(DATASOURCES_YAML)["datasources"]
    assert source["jsonData"]["httpMode"] == "POST"


def test_datasource_provisioning_is_influxql() -> None:
    """The datasource is InfluxDB in InfluxQL mode on database polca, URL from the environment."""
    config = _yaml(DATASOURCES_YAML)
    assert config["apiVersion"] == 1
    (source,) = config["datasources"]
    assert source["uid"] == "polca-influxdb"
    assert source["type"] == "influxdb"
    assert source["access"] == "proxy"
    assert source["url"] in {"$POLCA_INFLUX_URL", "${POLCA_INFLUX_URL}"}
    assert source["jsonData"]["version"] == "InfluxQL"
    assert source["jsonData"]["dbName"] == "polca"
    # Flux-mode settings would make Grafana send Flux to a 1.x server.
    assert not {"organization", "defaultBucket"} & set(source["jsonData"])


def test_dashboard_provider_loads_the_dashboards() -> None:
    """The provider reads JSON files from one absolute path into a polca folder."""
    config = _yaml(PROVIDERS_YAML)
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    assert provider["folder"] == "polca"
    assert Path(provider["options"]["path"]).is_absolute()
    assert provider["options"]["path"] in README.read_text(encoding="utf-8")
    assert set(_dashboards()) == {
        "polca-cooling.json",
        "polca-gpus.json",
        "polca-power-tree.json",
        "polca-row.json",
    }


def test_dashboards_are_well_formed() -> None:
    """Unique uids and panel ids, titles, provisioned datasources, InfluxQL raw targets."""
    uids = _provisioned_uids()
    problems: list[str] = []
    dashboard_uids: list[str] = []
    for name, board in _dashboards().items():
        dashboard_uids.append(board["uid"])
        if not board.get("title") or board.get("schemaVersion", 0) < 36:
            problems.append(f"{name}: needs a title and schemaVersion >= 36")
        ids = [panel["id"] for panel in _panels(board)]
        if len(ids) != len(set(ids)):
            problems.append(f"{name}: duplicate panel ids {sorted(ids)}")
        for panel in _panels(board):
            problems += _panel_problems(name, panel, uids)
        for annotation in board["annotations"]["list"]:
            if annotation.get("builtIn"):
                continue
            target = annotation.get("target", {})
            if annotation["datasource"].get("uid") not in uids:
                problems.append(f"{name}: annotation {annotation['name']!r} datasource")
            if not target.get("rawQuery") or target.get("query") != annotation.get("query"):
                problems.append(f"{name}: annotation {annotation['name']!r} target != query")
    assert len(dashboard_uids) == len(set(dashboard_uids)), dashboard_uids
    assert not problems, "\n".join(problems)


def _panel_problems(name: str, panel: Mapping[str, Any], uids: set[str]) -> list[str]:
    where = f"{name} panel {panel.get('id')} {panel.get('title')!r}"
    if not panel.get("title"):
        return [f"{where}: no title"]
    if panel.get("type") == "row":
        return []
    problems: list[str] = []
    if panel.get("datasource", {}).get("uid") not in uids:
        problems.append(f"{where}: datasource {panel.get('datasource')} is not provisioned")
    targets = panel.get("targets", [])
    if not targets:
        problems.append(f"{where}: no targets")
    ref_ids = [target.get("refId") for target in targets]
    if len(ref_ids) != len(set(ref_ids)):
        problems.append(f"{where}: duplicate refIds {ref_ids}")
    for target in targets:
        query = target.get("query")
        if target.get("rawQuery") is not True or not isinstance(query, str):
            problems.append(f"{where}: target {target.get('refId')} is not raw InfluxQL text")
            continue
        if target.get("datasource", {}).get("uid", "polca-influxdb") not in uids:
            problems.append(f"{where}: target {target['refId']} datasource")
        if not query.startswith("SELECT ") or "from(bucket" in query:
            problems.append(f"{where}: not an InfluxQL SELECT: {query}")
        if "$timeFilter" not in query:
            problems.append(f"{where}: no $timeFilter: {query}")
        if "GROUP BY time(" in query and "GROUP BY time($__interval)" not in query:
            problems.append(f"{where}: GROUP BY time without $__interval: {query}")
    return problems


def test_panels_tile_the_grid() -> None:
    """Panels stay inside the 24-column grid and do not overlap."""
    for name, board in _dashboards().items():
        taken: dict[tuple[int, int], int] = {}
        for panel in _panels(board):
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= GRID_COLUMNS, f"{name} panel {panel['id']} too wide"
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    other = taken.setdefault((x, y), panel["id"])
                    assert other == panel["id"], f"{name}: panels {other} and {panel['id']} overlap"


VARIABLES = {"polca-power-tree.json": {"site", "domain", "row"}}
"""The variables a dashboard must have, where not site, row and rack (the tree has no
racks: its domains and rows)."""


def test_template_variables_are_tag_queries_used_as_regexes() -> None:
    """Variables are SHOW TAG VALUES without $timeFilter, and used only as =~ /^$var$/."""
    uids = _provisioned_uids()
    for name, board in _dashboards().items():
        variables = board["templating"]["list"]
        names = {variable["name"] for variable in variables}
        assert VARIABLES.get(name, {"site", "row", "rack"}) <= names, name
        for variable in variables:
            assert variable["type"] == "query"
            assert variable["datasource"]["uid"] in uids
            assert variable["query"].startswith("SHOW TAG VALUES FROM ")
            assert "$timeFilter" not in variable["query"]
        texts = [q.text for q in _panel_queries(name, board) + _annotation_queries(name, board)]
        texts += [variable["query"] for variable in variables]
        for text in texts:
            bare = _REGEX_VARIABLE_RE.sub("", text)
            used = set(_VARIABLE_RE.findall(bare)) - {"timeFilter", "__interval"}
            assert not used, f"{name}: variables {used} not used as =~ /^$var$/ in {text}"
            assert set(_REGEX_VARIABLE_RE.findall(text)) <= names, f"{name}: undefined in {text}"


def test_readme_describes_every_panel() -> None:
    """deploy/grafana/README.md names every panel and the 2.x DBRP mapping command."""
    readme = README.read_text(encoding="utf-8")
    missing = [
        f"{name}: {panel['title']}"
        for name, board in _dashboards().items()
        for panel in _panels(board)
        if panel.get("type") != "row" and panel["title"] not in readme
    ]
    assert not missing, f"README.md does not describe: {missing}"
    assert "influx v1 dbrp create" in readme


# --- running the queries like Grafana ----------------------------------------------------------


def _regex_alternatives(values: list[str]) -> str:
    """Grafana's rendering of a multi-value variable in a regex: ``(a|b)``, escaped."""
    escaped = [re.sub(r"([\\/^$.|?*+()\[\]{}])", r"\\\1", value) for value in values]
    return "(" + "|".join(escaped) + ")"


def render(query: str, variables: Mapping[str, list[str]]) -> str:
    """The InfluxQL Grafana sends for ``query``: macros and ``/^$var$/`` variables replaced."""
    text = query.replace("$timeFilter", TIME_FILTER).replace("$__interval", INTERVAL)
    return _REGEX_VARIABLE_RE.sub(
        lambda m: "/^" + _regex_alternatives(variables.get(m.group(1), [])) + "$/", text
    )


def _group_by_tags(influxql: str) -> list[str]:
    """The tags the outermost query groups by (``time(...)`` left out)."""
    text = re.sub(r"time\([^)]*\)", "", influxql)
    clauses = re.findall(r"GROUP BY (.*?)(?: fill\(| ORDER | LIMIT |\)|$)", text)
    if not clauses:
        return []
    return re.findall(r'"(\w+)"', clauses[-1])


def check_query(
    server: InfluxDB1Process, query: str, variables: Mapping[str, list[str]]
) -> list[str]:
    """Problems with one dashboard query on ``server``; empty when every column has data.

    A problem is: a macro or variable left unsubstituted, an error from InfluxDB, no series
    at all, a series without a value for a tag the query groups by (a misspelt tag), or a
    selected column that is null everywhere; in a time series (``GROUP BY time``), also
    one that is zero everywhere (a wrong bit mask or a counter that never moves).
    """
    influxql = render(query, variables)
    if _LEFTOVER_RE.search(influxql):
        return [f"unsubstituted macro or variable in: {influxql}"]
    answer = server.query_raw(influxql)
    if "error" in answer:
        return [f"InfluxDB error {answer['error']!r} for: {influxql}"]
    empty = (None, 0) if "GROUP BY time(" in influxql else (None,)
    problems: list[str] = []
    for result in answer.get("results", []):
        if "error" in result:
            problems.append(f"InfluxDB error {result['error']!r} for: {influxql}")
            continue
        series = result.get("series", [])
        if not series:
            problems.append(f"no data for: {influxql}")
            continue
        for tag in _group_by_tags(influxql):
            if not all(s.get("tags", {}).get(tag) for s in series):
                problems.append(f"series without tag {tag!r} for: {influxql}")
        columns: list[str] = series[0]["columns"]
        for i, column in enumerate(columns):
            if column == "time":
                continue
            if all(row[i] in empty for s in series for row in s["values"]):
                problems.append(f"column {column!r} has no data for: {influxql}")
    return problems


def resolve_variables(server: InfluxDB1Process, board: Mapping[str, Any]) -> dict[str, list[str]]:
    """Run the template variable queries in order, as Grafana refreshes them; all values."""
    values: dict[str, list[str]] = {}
    for variable in board["templating"]["list"]:
        answer = server.query_raw(render(variable["query"], values))
        found = [
            row[1]
            for result in answer.get("results", [])
            for series in result.get("series", [])
            for row in series["values"]
        ]
        values[variable["name"]] = sorted(set(found))
    return values


# --- a simulated run ---------------------------------------------------------------------------

SITE, ROW = "dc1", "row-a"
RACKS = {"rack-01": ("node-01", "node-02"), "rack-02": ("node-03",)}
NODES = [node for nodes in RACKS.values() for node in nodes]
GPUS_PER_NODE = 8
MODEL = "NVIDIA H100 80GB HBM3"
DURATION_S = 120
BUDGET_W = 18_500.0
THRESHOLD_PCT = (85.0, 92.0, 98.0)
LEVEL_NAMES = ("nominal", "t1", "t2", "brake")
# (start second, level): the controller's decisions during the run.
LEVEL_STEPS = ((0, 0), (40, 1), (55, 2), (95, 1), (108, 0))
NODE_BASE_W = 1_500.0
GPU_IDLE_W, GPU_MAX_W = 90.0, 700.0
SM_MAX_MHZ = 1_980.0
# Bits of NVML's clock event reasons.
IDLE, SW_POWER_CAP, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x1, 0x4, 0x20, 0x40, 0x80
LOST_GPU = ("node-03", 7, 80)  # node, index, from second
STALE = ("node-02", range(100, 105))
OFFLINE = ("node-03", 112)  # its Last Will fires here; no telemetry afterwards
FAIL_SAFE = ("node-03", range(108, 112))


@dataclasses.dataclass(frozen=True, slots=True)
class _Loop:
    """One simulated cooling loop (one in-rack CDU) and the rack it cools."""

    cdu: str
    rack: str
    rated_kw: float
    design_flow_lpm: float
    heat_balance_factor: float  # measured heat removed against the racks' captured heat


LOOPS = {
    "loop-a": _Loop("cdu-a", "rack-01", 16.0, 24.0, 1.03),
    "loop-b": _Loop("cdu-b", "rack-02", 10.0, 15.0, 0.98),
}
LOOP_OF_RACK = {spec.rack: loop for loop, spec in LOOPS.items()}
CAPTURE_FRACTION = 0.8
CP_KJ_PER_KG_K = 4.18
SUPPLY_SETPOINT_C = 30.0
PUMP_FAILURE = ("loop-a", range(45, 85))  # one of its two pumps (N+1) failed
FLOW_DIP = ("loop-a", range(45, 50), 0.8)  # flow while the standby pump spins up
CDU_SILENT = ("loop-b", range(20, 28))  # no CDU telemetry; stale from 5 s on
STALE_AFTER_S = 5.0
LEAK = ("loop-b", range(70, 110))  # a leak detector not ok
FORCED_LEVEL = {0: 0, 1: 0, 2: 2, 3: 3}  # by severity: warning none, degraded T2, critical brake
FORCED_CLEAR_AFTER_S = 5
# (second, loop, alarm, severity, action, value, threshold, previous severity, detail): the
# supervisor's alarm changes for the faults above.
COOLING_ALARMS: tuple[tuple[int, str, str, str, str, float, float, str | None, str], ...] = (
    (25, "loop-b", "telemetry_stale", "warning", "raised", 5.5, 5.0, None,
     "no CDU telemetry for 5.5 s (limit 5.0 s)"),
    (28, "loop-b", "telemetry_stale", "warning", "cleared", 0.5, 5.0, "warning",
     "no CDU telemetry for 0.5 s (back past 5.0 s)"),
    (45, "loop-a", "pump_failure", "degraded", "raised", 1.0, 1.0, None,
     "pumps available 1 (limit 1): pump-2"),
    (46, "loop-a", "flow_low", "warning", "raised", 0.8, 0.85, None,
     "flow 80% of design (limit 85% of design)"),
    (50, "loop-a", "flow_low", "warning", "cleared", 1.0, 0.9, "warning",
     "flow 100% of design (back past 90% of design)"),
    (70, "loop-b", "leak", "warning", "raised", 1.0, 1.0, None,
     "leak detectors not ok 1 (limit 1): tray-3"),
    (85, "loop-a", "pump_failure", "degraded", "cleared", 2.0, 2.0, "degraded",
     "pumps available 2 (back past 2)"),
    (100, "loop-b", "leak", "critical", "escalated", 1.0, 1.0, "warning",
     "leak detectors not ok 1 (limit 1): tray-3"),
    (105, "loop-b", "leak", "warning", "deescalated", 1.0, 1.0, "critical",
     "leak detectors not ok 1 (limit 1): tray-3"),
    (110, "loop-b", "leak", "warning", "cleared", 0.0, 0.0, "warning",
     "leak detectors not ok 0 (back past 0)"),
)  # fmt: skip
SEVERITY_RANK = {"warning": 1, "degraded": 2, "critical": 3}


def _tag(value: str) -> str:
    return re.sub(r"([,= ])", r"\\\1", value)


def _string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _line(
    measurement: str, tags: Mapping[str, str], fields: Mapping[str, object], ts_ms: int
) -> str:
    """One line of line protocol; ints get the ``i`` suffix, floats stay floats."""
    tag_text = ",".join(f"{key}={_tag(value)}" for key, value in tags.items())
    parts = []
    for key, value in fields.items():
        if isinstance(value, bool):
            msg = f"booleans are not part of polca's schema: {key}"
            raise TypeError(msg)
        if isinstance(value, int):
            parts.append(f"{key}={value}i")
        elif isinstance(value, float):
            parts.append(f"{key}={value!r}")
        else:
            parts.append(f"{key}={_string(str(value))}")
    return f"{measurement},{tag_text} {','.join(parts)} {ts_ms}"


def _load(t: int) -> float:
    """Share of full GPU power the inference load asks for at second ``t``."""
    if t < 20:
        return 0.3
    if t < 60:
        return 0.3 + 0.7 * (t - 20) / 40
    if t < 90:
        return 1.0
    return max(0.4, 1.0 - 0.6 * (t - 90) / 20)


def _level(t: int) -> int:
    """The level in force at second ``t``: that of the last step started by then."""
    return [level for start, level in LEVEL_STEPS if start <= t][-1]


def _caps(level: int, gpu_class: str) -> tuple[float, float]:
    """(power limit W, locked SM clock ceiling MHz) for a class at a level."""
    if level == 0:
        return GPU_MAX_W, SM_MAX_MHZ
    if gpu_class == "high":
        return (GPU_MAX_W, SM_MAX_MHZ) if level == 1 else (600.0, SM_MAX_MHZ)
    return (550.0, 1_700.0) if level == 1 else (450.0, 1_500.0)


@dataclasses.dataclass(slots=True)
class _Cooling:
    """What the loop supervisor carries from one interval to the next."""

    rack_power_w: dict[str, float] = dataclasses.field(default_factory=dict)
    lagged_heat_kw: dict[str, float] = dataclasses.field(default_factory=dict)
    active: dict[str, dict[str, int]] = dataclasses.field(
        default_factory=lambda: {loop: {} for loop in LOOPS}
    )
    forced: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(LOOPS, 0))
    release_since: dict[str, int | None] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(LOOPS)
    )


@dataclasses.dataclass(slots=True)
class _Counters:
    energy_j: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    messages_in: int = 0
    dropped: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(
            ("malformed", "oversized", "schema_version", "topology", "stale_seq"), 0
        )
    )
    outbox_dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    control_rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    cooling: _Cooling = dataclasses.field(default_factory=_Cooling)


def _gpu_lines(
    t: int, ts_ms: int, rack: str, node: str, counters: _Counters
) -> tuple[list[str], float, int]:
    """One node's GPU points at second ``t``; also their power sum and lost-GPU count."""
    lines: list[str] = []
    power_sum_w = 0.0
    lost = 0
    level = _level(t)
    for index in range(GPUS_PER_NODE):
        gpu_class = "high" if index < 2 else "low"
        tags = {
            "site": SITE, "row": ROW, "rack": rack, "node": node,
            "gpu_uuid": f"GPU-{NODES.index(node):02d}{index:02d}-polca-sim",
            "gpu_index": str(index), "model": MODEL, "class": gpu_class,
        }  # fmt: skip
        if (node, index) == LOST_GPU[:2] and t >= LOST_GPU[2]:
            lines.append(_line("gpu", tags, {"lost": 1.0}, ts_ms))
            lost += 1
            continue
        limit_w, ceiling_mhz = _caps(level, gpu_class)
        demand_w = GPU_IDLE_W + (GPU_MAX_W - GPU_IDLE_W) * _load(t) * (0.9 + 0.015 * index)
        power_w = min(demand_w, limit_w)
        temp_c = 30.0 + 0.07 * power_w + (6.0 if node == "node-02" and index == 5 else 0.0)
        reasons = IDLE if _load(t) < 0.35 else 0
        if demand_w > limit_w:
            reasons |= SW_POWER_CAP
        if node == "node-01" and index in {2, 3} and 56 <= t < 61:
            reasons |= HW_POWER_BRAKE
        if node == "node-02" and index == 5 and 70 <= t < 86:
            reasons |= SW_THERMAL | (HW_THERMAL if 75 <= t < 79 else 0)
        key = (node, index)
        counters.energy_j[key] = counters.energy_j.get(key, 0.0) + power_w
        sm_mhz = min(ceiling_mhz, SM_MAX_MHZ * (0.75 + 0.25 * power_w / GPU_MAX_W))
        fields: dict[str, object] = {
            "power_w": round(power_w, 1), "power_max_w": round(power_w * 1.04, 1),
            "power_avg_w": round(power_w * 0.99, 1),
            "energy_j": round(counters.energy_j[key], 1), "energy_delta_j": round(power_w, 1),
            "temp_c": round(temp_c, 1), "temp_max_c": round(temp_c + 1.5, 1),
            "mem_temp_c": round(temp_c + 7.0, 1),
            "sm_clock_mhz": float(round(sm_mhz)), "mem_clock_mhz": 2619.0,
            "util_pct": round(100.0 * _load(t), 1), "mem_util_pct": round(60.0 * _load(t), 1),
            "power_limit_w": GPU_MAX_W, "enforced_power_limit_w": limit_w,
            "locked_sm_clock_max_mhz": ceiling_mhz, "clock_event_reasons": reasons, "lost": 0.0,
        }  # fmt: skip
        lines.append(_line("gpu", tags, fields, ts_ms))
        power_sum_w += power_w
        if t % 10 == 9:  # health counters: sent on change and every interval of the agent
            lines.append(_health_line(t, ts_ms, tags))
    return lines, power_sum_w, lost


def _health_line(t: int, ts_ms: int, gpu_tags: dict[str, str]) -> str:
    """A GPU's health counters at ``t``: an XID on node-01/gpu3 at 60 s, uncorrectable ECC
    and a pending remap on node-02/gpu5 from 80 s, brake and thermal time as the throttle
    reasons above say."""
    node, index = gpu_tags["node"], int(gpu_tags["gpu_index"])
    key = (node, index)
    brake = 5 if node == "node-01" and index in {2, 3} and t >= 61 else 0
    thermal = min(16, max(0, t - 70)) if node == "node-02" and index == 5 else 0
    bad = node == "node-02" and index == 5 and t >= 80
    fields: dict[str, object] = {
        "xid_errors": 1 if key == ("node-01", 3) and t >= 60 else 0,
        "ecc_corrected_volatile": 3 if bad else 0,
        "ecc_uncorrected_volatile": 2 if bad else 0,
        "remapped_rows_uncorrectable": 1 if bad else 0,
        "row_remap_pending": 1.0 if bad else 0.0,
        "pcie_replays": 0,
        "power_brake_s": float(brake),
        "hw_thermal_slowdown_s": float(min(4, max(0, t - 75)) if thermal else 0),
        "sw_thermal_slowdown_s": float(thermal),
    }
    if key == ("node-01", 3) and t >= 60:
        fields["last_xid"] = 79
    tags = {k: v for k, v in gpu_tags.items() if k != "class"}
    return _line("gpu_health", tags, fields, ts_ms)


def make_run(now_ms: int) -> list[str]:
    """Line protocol (ms) for every polca measurement: a 120 s run ending at ``now_ms``."""
    lines: list[str] = []
    counters = _Counters()
    previous_row_w: float | None = None
    seq = 0
    for t in range(DURATION_S):
        ts_ms = now_ms - (DURATION_S - t) * 1000
        level = _level(t)
        row_w = 0.0
        row_counts = {"online": 0, "stale": 0, "offline": 0}
        for rack, nodes in RACKS.items():
            rack_w = 0.0
            rack_counts = {"online": 0, "stale": 0, "offline": 0}
            for node in nodes:
                offline = node == OFFLINE[0] and t >= OFFLINE[1]
                stale = node == STALE[0] and t in STALE[1]
                gpu_w = 0.0
                lost = 0
                if not offline and not stale:
                    gpu_lines, gpu_w, lost = _gpu_lines(t, ts_ms, rack, node, counters)
                    lines += gpu_lines
                    counters.messages_in += 1
                else:
                    # A stale or offline node counts at its GPUs' full power (conservative).
                    gpu_w = GPU_MAX_W * GPUS_PER_NODE
                node_w = gpu_w + NODE_BASE_W
                state = "offline" if offline else "stale" if stale else "online"
                rack_counts[state] += 1
                row_counts[state] += 1
                if t % 30 == 29:
                    counters.outbox_dropped[node] = counters.outbox_dropped.get(node, 0) + 1
                if node == "node-02" and t == 70:
                    counters.control_rejected[node] = 1
                node_fields: dict[str, object] = {
                    "gpu_power_w": round(gpu_w, 1), "power_w": round(node_w, 1),
                    "energy_delta_j": round(node_w, 1), "level": float(level),
                    "fail_safe": float(node == FAIL_SAFE[0] and t in FAIL_SAFE[1]),
                    "online": float(not offline), "stale": float(stale),
                    "gpus": float(GPUS_PER_NODE), "gpus_lost": float(lost),
                    "tick_p99_ms": 4.0 + 0.5 * (t % 7),
                    "outbox_dropped": counters.outbox_dropped.get(node, 0),
                    "control_rejected": counters.control_rejected.get(node, 0),
                }  # fmt: skip
                node_tags = {"site": SITE, "row": ROW, "rack": rack, "node": node}
                lines.append(_line("node", node_tags, node_fields, ts_ms))
                rack_w += node_w
            rack_fields: dict[str, object] = {
                "power_w": round(rack_w, 1),
                "budget_w": 11_000.0,
                "thermal_budget_w": round(_thermal_budget_w(LOOP_OF_RACK[rack], t), 1),
                **{f"nodes_{k}": float(v) for k, v in rack_counts.items()},
            }
            lines.append(
                _line("rack", {"site": SITE, "row": ROW, "rack": rack}, rack_fields, ts_ms)
            )
            row_w += rack_w
            counters.cooling.rack_power_w[rack] = rack_w
        trend_w_per_s = 0.0 if previous_row_w is None else row_w - previous_row_w
        previous_row_w = row_w
        measured_w = row_w * 1.01
        row_fields: dict[str, object] = {
            "power_w": round(measured_w, 1), "computed_power_w": round(row_w, 1),
            "measured_power_w": round(measured_w, 1), "budget_w": BUDGET_W,
            "effective_budget_w": BUDGET_W,
            "power_pct": round(100.0 * measured_w / BUDGET_W, 2), "level": float(level),
            **{f"threshold_{i + 1}_w": BUDGET_W * pct / 100 for i, pct in enumerate(THRESHOLD_PCT)},
            "trend_w_per_s": round(trend_w_per_s, 1),
            **{f"nodes_{k}": float(v) for k, v in row_counts.items()},
            **_row_budget_fields(t),
        }  # fmt: skip
        lines += [_line("row", {"site": SITE, "row": ROW}, row_fields, ts_ms),
                  *_tree_lines(t, ts_ms, measured_w)]  # fmt: skip
        changed = t > 0 and level != _level(t - 1)
        if changed or t % 10 == 0:
            seq += 1
            lines += _control_lines(t, ts_ms, level, seq, changed=changed, power_w=measured_w)
        lines += _event_lines(t, ts_ms)
        lines += _cooling_lines(t, ts_ms, counters.cooling)
        lines += _aggregator_lines(t, ts_ms, counters, points=len(lines))
        lines += _leadership_lines(t, ts_ms)
    return lines


# The site's power tree above the row: a switchboard on the utility feeding a UPS with two
# feeds and a battery, which supplies the row. Breaker B trips, the UPS runs on its
# battery, feed A's meter goes dark, an operator limits the UPS, the site controller is
# lost for a while (no tree points; the row's lease lapses to its fallback).
TREE = build_tree(
    {
        "rows": {ROW: {"rating_w": 20_000}},
        "domains": {
            "swb-1": {"kind": "switchboard", "rating_w": 40_000, "supplies": ["ups-a"],
                      "feeds": [{"name": "utility", "rating_w": 40_000, "sources": ["swb-in"]}]},
            "ups-a": {"kind": "ups", "rating_w": 24_000, "battery_w": 15_000, "supplies": [ROW],
                      "feeds": [{"name": "A", "rating_w": 12_000, "sources": ["ups-a-in"]},
                                {"name": "B", "rating_w": 12_000, "sources": ["pdu-b"]}]},
        },
    }
)[0]  # fmt: skip
TREE_DOMAINS = ("swb-1", "ups-a")
FEED_B_DOWN = range(30, 60)
ON_BATTERY = range(70, 80)
FEED_A_DARK = range(84, 90)  # polls without an answer; down from the third
UPS_LIMIT = (range(90, 112), 16_000.0)
SITE_LOST = range(100, 106)  # no allocation: no tree points
SUMMARY_STALE = range(96, 100)
ROW_FALLBACK = range(103, 108)  # the lease (3 s) lapsed after the site controller was lost


def _tree_state(t: int) -> SiteState:
    feeds: dict[tuple[str, str], FeedState] = {
        ("swb-1", "utility"): FeedState("up"),
        ("ups-a", "A"): FeedState("up"),
        ("ups-a", "B"): FeedState("down" if t in FEED_B_DOWN else "up"),
    }
    if t in FEED_A_DARK:
        feeds["ups-a", "A"] = FeedState("up", dark_polls=t - FEED_A_DARK.start + 1)
    window, limit_w = UPS_LIMIT
    return SiteState(
        feeds=feeds,
        on_battery=frozenset({"ups-a"} if t in ON_BATTERY else ()),
        dark_polls_down=3,
        limits_w={"ups-a": limit_w} if t in window else {},
    )


def _tree_lines(t: int, ts_ms: int, row_w: float) -> list[str]:
    """The site controller's points at second ``t``: the real allocation of the tree's
    state then, built by ``sitectl.points``."""
    if t in SITE_LOST:
        return []
    assert TREE is not None
    state = _tree_state(t)
    demand = RowDemand(floor_w=6_000.0, demand_w=(0.4 * row_w, 0.6 * row_w))
    allocation = allocate(TREE, state, {ROW: demand})
    measured = {ROW: row_w, "ups-a": row_w, "swb-1": row_w}
    stale = (ROW,) if t in SUMMARY_STALE else ()
    step = SiteStep.of(TREE, allocation, state, measured, stale)
    written = site_points.step_points(
        step, TREE, site=SITE, ts_ns=ts_ms * 1_000_000, leadership=Leadership()
    )
    return [point.to_line("ms") for point in written]


def _row_budget_fields(t: int) -> dict[str, object]:
    """The row's budget in force at second ``t``, as its aggregator writes it: on its
    fallback before the first lease and once the lease lapsed, its own feeds' rating while
    breaker B is open (before the site controller's lease follows), else the lease."""
    leased = 12_000.0 if t in FEED_B_DOWN else UPS_LIMIT[1] if t in UPS_LIMIT[0] else BUDGET_W
    if t < 3 or t in ROW_FALLBACK:
        return {"electrical_budget_w": 10_000.0, "budget_origin": "fallback", "on_fallback": 1.0}
    fields: dict[str, object] = {"leased_budget_w": leased, "on_fallback": 0.0}
    if t in FEED_B_DOWN[:2]:
        fields["leased_budget_w"] = BUDGET_W
        return {**fields, "electrical_budget_w": 12_000.0, "budget_origin": "feeds",
                "budget_limited_by": "feed B"}  # fmt: skip
    origin = "lease" if leased < BUDGET_W else "config"
    fields |= {"electrical_budget_w": leased, "budget_origin": origin}
    if origin == "lease":
        fields["budget_limited_by"] = "ups-a"
    return fields


LEADER_CHANGES = {0: ("agg-1", 7), 70: ("agg-2", 12)}
"""When the row's shard changed leader in the run (the agg-1 instance killed at 70 s)."""


def _leadership_lines(t: int, ts_ms: int) -> list[str]:
    """The ``leadership`` points of the two instances of the row's shard, as the
    aggregator writes them (``points.leader_point``) when the lead changes."""
    if t not in LEADER_CHANGES:
        return []
    leader, term = LEADER_CHANGES[t]
    return [
        points.leader_point(
            ts_ns=ts_ms * 1_000_000,
            site=SITE,
            instance=instance,
            shard=ROW,
            role="leader" if instance == leader else "standby",
            term=term,
            leader=leader,
            leader_term=term,
        ).to_line("ms")
        for instance in ("agg-1", "agg-2")
    ]


def _control_lines(
    t: int, ts_ms: int, level: int, seq: int, *, changed: bool, power_w: float
) -> list[str]:
    """A control decision (or renewal) and, for a change, its audit events."""
    pct = 100.0 * power_w / BUDGET_W
    reason = f"row power {pct:.1f}% of budget; level {LEVEL_NAMES[level]}"
    control = {
        "level": float(level), "seq": seq, "lease_s": 30.0, "observe": 0.0,
        "level_name": LEVEL_NAMES[level], "reason": reason,
    }  # fmt: skip
    lines = [_line("control", {"site": SITE, "row": ROW, "scope": "row"}, control, ts_ms)]
    if not changed:
        return lines
    before = LEVEL_NAMES[_level(t - 1)]
    detail = json.dumps({"from": before, "to": LEVEL_NAMES[level], "power_pct": round(pct, 1)})
    event = {"text": f"{ROW}: {before} -> {LEVEL_NAMES[level]} ({reason})", "detail": detail}
    row_tags = {"site": SITE, "row": ROW, "kind": "level_changed"}
    lines.append(_line("event", row_tags, event, ts_ms))
    for rack, nodes in RACKS.items():
        for node in nodes:
            tags = {"site": SITE, "row": ROW, "rack": rack, "node": node, "kind": "cap_changed"}
            cap_w, _ = _caps(level, "low")
            fields = {"text": f"low-priority GPUs capped at {cap_w:.0f} W", "gpu": 2.0,
                      "detail": json.dumps({"cap_w": cap_w, "class": "low"})}  # fmt: skip
            lines.append(_line("event", tags, fields, ts_ms + 5))
    return lines


def _event_lines(t: int, ts_ms: int) -> list[str]:
    """The audit events of second ``t`` that are not level changes."""
    rack_of = {node: rack for rack, nodes in RACKS.items() for node in nodes}
    events: list[tuple[dict[str, str], dict[str, object]]] = []
    node, index, lost_at = LOST_GPU
    if t == lost_at:
        tags = {"rack": rack_of[node], "node": node, "kind": "gpu_lost"}
        fields: dict[str, object] = {
            "text": f"GPU {index} stopped answering NVML", "gpu": float(index),
            "detail": json.dumps({"nvml_error": "GPU is lost"}),
        }  # fmt: skip
        events.append((tags, fields))
    if t == FAIL_SAFE[1].start:
        node = FAIL_SAFE[0]
        tags = {"rack": rack_of[node], "node": node, "kind": "fail_safe_entered"}
        events.append((tags, {"text": "control lease expired", "detail": "{}"}))
    if t == 20:
        fields = {"text": "policy edit rejected: thresholds must ascend", "detail": '{"rev": 7}'}
        events.append(({"kind": "policy_rejected"}, fields))
    return [
        _line("event", {"site": SITE, "row": ROW, **tags}, fields, ts_ms) for tags, fields in events
    ]


def _aggregator_lines(t: int, ts_ms: int, counters: _Counters, *, points: int) -> list[str]:
    """The aggregator's own counters, cumulative since its start."""
    # One burst of drops per reason, and a database outage that fills the spool.
    bursts = {
        30: "malformed",
        40: "oversized",
        50: "topology",
        65: "stale_seq",
        75: "schema_version",
    }
    if t in bursts:
        counters.dropped[bursts[t]] += 2
    spooled = 40 * (t - 80) if 80 <= t < 100 else 0
    dropped_total = sum(counters.dropped.values())
    fields: dict[str, object] = {
        "messages_in": counters.messages_in + dropped_total,
        "messages_dropped": dropped_total,
        "points_written": points,
        "points_dropped": 0 if t < 95 else 12,
        "points_spooled": spooled,
        "spool_bytes": 96 * spooled,
        **{f"dropped_{reason}": count for reason, count in counters.dropped.items()},
    }
    return [_line("aggregator", {"site": SITE, "instance": "agg-1"}, fields, ts_ms)]


def _derate(loop: str, t: int) -> float:
    """The loop's capacity factor at second ``t``: flow, pumps (N of N+1) and stale telemetry."""
    flow = FLOW_DIP[2] if loop == FLOW_DIP[0] and t in FLOW_DIP[1] else 1.0
    pumps = 0.9 if loop == PUMP_FAILURE[0] and t in PUMP_FAILURE[1] else 1.0
    stale = 0.75 if _cdu_age_s(loop, t) >= STALE_AFTER_S else 1.0
    return max(0.05, min(flow, pumps) * stale)


def _cdu_age_s(loop: str, t: int) -> float:
    """Age of the loop's newest CDU reading at second ``t``."""
    silent_loop, silent = CDU_SILENT
    if loop == silent_loop and t in silent:
        return t - silent.start + 0.5
    return 0.3 + 0.1 * (t % 5)


def _thermal_budget_w(loop: str, t: int) -> float:
    """The power (rack electrical watts) the loop's derated capacity can take away."""
    return LOOPS[loop].rated_kw * _derate(loop, t) * 1000.0 / CAPTURE_FRACTION


def _cooling_lines(t: int, ts_ms: int, state: _Cooling) -> list[str]:
    """The loops' assessments at second ``t``, and the alarm changes of that second."""
    lines: list[str] = []
    for second, loop, alarm, severity, action, value, threshold, before, detail in COOLING_ALARMS:
        if second != t:
            continue
        if action == "cleared":
            state.active[loop].pop(alarm)
        else:
            state.active[loop][alarm] = SEVERITY_RANK[severity]
        tags = {"site": SITE, "loop": loop, "alarm": alarm, "severity": severity,
                "action": action}  # fmt: skip
        fields: dict[str, object] = {
            "value": value, "threshold": threshold, "rank": float(SEVERITY_RANK[severity]),
            "text": f"{loop}: {alarm} {action} ({severity}): {detail}", "detail": detail,
        }  # fmt: skip
        if before is not None:
            fields["previous_severity"] = before
        lines.append(_line("cooling_alarm", tags, fields, ts_ms))
    lines += [_loop_line(t, ts_ms, loop, state) for loop in LOOPS]
    return lines


def _loop_line(t: int, ts_ms: int, loop: str, state: _Cooling) -> str:
    """One ``cooling_loop`` point: heat, capacity, temperatures, pumps, alarms."""
    spec = LOOPS[loop]
    heat_kw = state.rack_power_w[spec.rack] * CAPTURE_FRACTION / 1000.0
    # The racks' heat reaches the CDU's sensors with a first-order lag of about 10 s.
    lagged_kw = state.lagged_heat_kw.get(loop, heat_kw)
    lagged_kw += (heat_kw - lagged_kw) / 10.0
    state.lagged_heat_kw[loop] = lagged_kw
    removed_kw = lagged_kw * spec.heat_balance_factor
    capacity_kw = spec.rated_kw * _derate(loop, t)
    severity = max(state.active[loop].values(), default=0)
    target = FORCED_LEVEL[severity]
    if target >= state.forced[loop]:
        state.forced[loop], state.release_since[loop] = target, None
    else:
        since = state.release_since[loop]
        if since is None:
            state.release_since[loop] = t
        elif t - since >= FORCED_CLEAR_AFTER_S:
            state.forced[loop] -= 1
            state.release_since[loop] = t if state.forced[loop] > target else None
    pump_failed = loop == PUMP_FAILURE[0] and t in PUMP_FAILURE[1]
    fields: dict[str, object] = {
        "heat_load_kw": round(heat_kw, 3), "rated_capacity_kw": spec.rated_kw,
        "capacity_kw": round(capacity_kw, 3), "headroom_kw": round(capacity_kw - heat_kw, 3),
        "load_pct": round(100.0 * heat_kw / capacity_kw, 2),
        "derate_fraction": _derate(loop, t),
        "pumps_failed": float(pump_failed),
        "leaks": float(loop == LEAK[0] and t in LEAK[1]),
        "thermal_budget_w": round(_thermal_budget_w(loop, t), 1),
        "forced_level": float(state.forced[loop]), "severity": float(severity),
        "alarms": float(len(state.active[loop])), "emergency": float(severity == 3),
        "stale": float(_cdu_age_s(loop, t) >= STALE_AFTER_S),
        "telemetry_age_s": _cdu_age_s(loop, t),
    }  # fmt: skip
    if not (loop == CDU_SILENT[0] and t in CDU_SILENT[1]):  # no reading: left out
        flow_fraction = FLOW_DIP[2] if loop == FLOW_DIP[0] and t in FLOW_DIP[1] else 1.0
        flow_lpm = spec.design_flow_lpm * flow_fraction
        delta_t_c = removed_kw / (flow_lpm / 60.0 * CP_KJ_PER_KG_K)
        supply_c = SUPPLY_SETPOINT_C + 0.2 * lagged_kw / spec.rated_kw
        fields |= {
            "heat_removed_kw": round(removed_kw, 3),
            "heat_balance_error_pct": round(100.0 * (spec.heat_balance_factor - 1.0), 2),
            "supply_temp_c": round(supply_c, 2), "return_temp_c": round(supply_c + delta_t_c, 2),
            "delta_t_c": round(delta_t_c, 2), "flow_lpm": round(flow_lpm, 2),
            "flow_fraction": flow_fraction, "pumps_available": 2.0 - pump_failed,
        }  # fmt: skip
    return _line("cooling_loop", {"site": SITE, "loop": loop, "cdu": spec.cdu}, fields, ts_ms)


@pytest.fixture(scope="module")
def simulated_run(grafana_influxdb: InfluxDB1Process) -> InfluxDB1Process:
    """The module's InfluxDB with a 120 s simulated run ending now."""
    grafana_influxdb.write("\n".join(make_run(math.floor(time.time() * 1000))).encode())
    return grafana_influxdb


# --- every query against the simulated run -----------------------------------------------------


def test_every_template_variable_finds_values(simulated_run: InfluxDB1Process) -> None:
    """Each variable query, with the variables before it substituted, returns tag values."""
    for name, board in _dashboards().items():
        values = resolve_variables(simulated_run, board)
        assert values["site"] == [SITE], name
        assert values["row"] == [ROW], name
        if "rack" in values:
            assert values["rack"] == sorted(RACKS), name
        if "domain" in values:
            assert values["domain"] == sorted(TREE_DOMAINS), name
        if "node" in values:
            assert values["node"] == sorted(NODES), name
        if "loop" in values:
            assert values["loop"] == sorted(LOOPS), name
    assert "loop" in resolve_variables(simulated_run, _dashboards()["polca-cooling.json"])
    assert "domain" in resolve_variables(simulated_run, _dashboards()["polca-power-tree.json"])


def test_every_panel_query_returns_data(simulated_run: InfluxDB1Process) -> None:
    """Every panel target runs on InfluxDB 1.x and fills every column it selects."""
    checked = 0
    problems: list[str] = []
    for name, board in _dashboards().items():
        variables = resolve_variables(simulated_run, board)
        for query in _panel_queries(name, board):
            problems += [
                f"{query.where}: {p}" for p in check_query(simulated_run, query.text, variables)
            ]
            checked += 1
    assert checked >= 55
    assert not problems, "\n".join(problems)


def test_every_annotation_query_returns_events(simulated_run: InfluxDB1Process) -> None:
    """The level-change, fault and cooling-alarm annotations find their events, with text."""
    expected = {
        "Leader changes": len(LEADER_CHANGES),
        "Level changes": len(LEVEL_STEPS) - 1,
        "Cooling alarms": sum(1 for change in COOLING_ALARMS if change[4] != "deescalated"),
    }
    counted: set[str] = set()
    for name, board in _dashboards().items():
        variables = resolve_variables(simulated_run, board)
        queries = _annotation_queries(name, board)
        assert queries, f"{name} has no InfluxDB annotation"
        for query in queries:
            assert check_query(simulated_run, query.text, variables) == [], query.where
        for annotation in board["annotations"]["list"]:
            if annotation["name"] not in expected:
                continue
            answer = simulated_run.query_raw(render(annotation["query"], variables))
            texts = [row[1] for row in answer["results"][0]["series"][0]["values"]]
            assert len(texts) == expected[annotation["name"]], (name, texts)
            counted.add(f"{name}: {annotation['name']}")
    assert counted >= {
        "polca-row.json: Leader changes",
        "polca-row.json: Level changes",
        "polca-gpus.json: Level changes",
        "polca-power-tree.json: Level changes",
        "polca-cooling.json: Cooling alarms",
    }, counted


def test_checker_reports_unknown_field(simulated_run: InfluxDB1Process) -> None:
    """A query on a field that does not exist is reported as returning no data."""
    variables = {"site": [SITE], "row": [ROW]}
    query = (
        'SELECT mean("no_such_field_w") FROM "row" WHERE "site" =~ /^$site$/ '
        'AND "row" =~ /^$row$/ AND $timeFilter GROUP BY time($__interval)'
    )
    assert check_query(simulated_run, query, variables) == [
        f"no data for: {render(query, variables)}"
    ]


def test_checker_reports_broken_queries(simulated_run: InfluxDB1Process) -> None:
    """A misspelt field or tag, a mask that never matches, bad InfluxQL, a stray variable."""
    variables = {"site": [SITE], "row": [ROW]}
    cases = {
        'SELECT mean("power_w"), mean("powr_w") FROM "row" WHERE $timeFilter': "column 'mean_1'",
        'SELECT mean("power_w") FROM "gpu" WHERE $timeFilter GROUP BY time($__interval), '
        '"node", "gpu_idx"': "series without tag 'gpu_idx'",
        'SELECT sum("m") FROM (SELECT "clock_event_reasons" & 256 AS "m" FROM "gpu" '
        "WHERE $timeFilter) WHERE $timeFilter GROUP BY time($__interval)": "column 'sum'",
        'SELEC "power_w" FROM "row"': "InfluxDB error",
        'SELECT "power_w" FROM "row" WHERE $node': "unsubstituted",
    }
    for query, expected in cases.items():
        problems = check_query(simulated_run, query, variables)
        assert len(problems) == 1, (query, problems)
        assert problems[0].startswith(expected), (query, problems)
