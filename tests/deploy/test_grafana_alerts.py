"""Grafana alert rules for polca's InfluxDB data: structure, and every rule against real data.

``deploy/grafana/provisioning/alerting/polca-alerts.yaml`` raises the conditions of the
Prometheus rules (``deploy/prometheus/polca-rules.yml``) from the InfluxDB history. There is
no Grafana here, so these tests check what can go wrong without one: the provisioning
structure (keys, uids, refIds, datasource, expression types), that each Prometheus alert
but ``PROMETHEUS_ONLY`` has a rule with its title, severity, ``for`` and runbook, that
queries name only measurements, fields and tags of ``polca.export.schema.SCHEMA`` and group
by the labels the alert is about. Then a scenario is written into a real InfluxDB 1.x (a
server of this module's own, ``grafana_influxdb`` being module-scoped), each rule's query
runs as Grafana would send it, and the rule's own reduce and threshold steps are applied by
a small evaluator of those expression types: every rule must fire on the series meant to
raise it and stay silent on the others (a lower value, a counter reset, an increase before
the window, a condition that has cleared).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from polca.export.points import Point, encode_lines, make_point
from polca.export.schema import SCHEMA
from tests.deploy.test_grafana import check_query, render
from tests.tsdb import InfluxDB1Process

ROOT = Path(__file__).resolve().parents[2]
ALERTS_YAML = ROOT / "deploy" / "grafana" / "provisioning" / "alerting" / "polca-alerts.yaml"
DATASOURCES_YAML = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "polca.yaml"
PROMETHEUS_RULES = ROOT / "deploy" / "prometheus" / "polca-rules.yml"
GRAFANA_README = ROOT / "deploy" / "grafana" / "README.md"
PROMETHEUS_DOC = ROOT / "docs" / "prometheus.md"

# The lease runs on the node's monotonic clock; only the agent's /metrics shows it. A site
# controller lost is series gone, which is no data (OK) for a Grafana rule.
PROMETHEUS_ONLY = frozenset({"PolcaLeaseExpiring", "PolcaSiteControllerLost"})
RULE_KEYS = frozenset(
    {"uid", "title", "condition", "data", "noDataState", "execErrState", "for", "labels",
     "annotations"}
)  # fmt: skip
# Grafana's server-side expression types, and what the reduce and threshold steps take.
EXPRESSION_TYPES = frozenset({"math", "reduce", "resample", "classic_conditions", "threshold"})
REDUCERS = frozenset({"last", "max", "min", "mean", "sum", "count"})
REDUCE_MODES = frozenset({"", "dropNN", "replaceNN"})
THRESHOLD_PARAMS = {"gt": 1, "lt": 1, "within_range": 2, "outside_range": 2}
# The state rules read the latest value of this window (covers write_every_s up to 60 s).
STATE_WINDOW_S = 120
# Prometheus labels and the InfluxDB tags that carry the same thing; `reason` is part of
# the field names (dropped_<reason>), not a tag.
PROMETHEUS_TAG = {"gpu": "gpu_index", "uuid": "gpu_uuid"}
NOT_A_TAG = frozenset({"reason"})

_DURATION_RE = re.compile(r"(\d+)([smh])")
_QUOTED_RE = re.compile(r'"(\w+)"')
_GROUP_BY_RE = re.compile(r'GROUP BY ((?:"\w+"(?:, )?)+)')
_WHERE_RE = re.compile(r"WHERE (.*?)(?= GROUP BY|\)|$)")
_TEMPLATE_LABEL_RE = re.compile(r"\$labels\.(\w+)")
_TEMPLATE_VALUE_RE = re.compile(r"\$values\.(\w+)")

Labels = tuple[tuple[str, str], ...]
Frames = dict[Labels, list[float]]

# --- the files ---------------------------------------------------------------------------------


def _yaml(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return loaded


def _groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = _yaml(ALERTS_YAML)["groups"]
    return groups


def _rules() -> dict[str, dict[str, Any]]:
    """Every Grafana rule by title."""
    return {rule["title"]: rule for group in _groups() for rule in group["rules"]}


def _group_of() -> dict[str, str]:
    return {rule["title"]: group["name"] for group in _groups() for rule in group["rules"]}


def _prometheus_rules() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every Prometheus alert by name, with its group's name."""
    return {
        rule["alert"]: (group["name"], rule)
        for group in _yaml(PROMETHEUS_RULES)["groups"]
        for rule in group["rules"]
    }


def _datasource_uid() -> str:
    (source,) = _yaml(DATASOURCES_YAML)["datasources"]
    uid: str = source["uid"]
    return uid


def _seconds(duration: str) -> int:
    """``10m``, ``1m30s``, ``0s`` in seconds; anything else fails the test."""
    assert re.fullmatch(r"(?:\d+[smh])+", duration), duration
    factor = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * factor[unit] for n, unit in _DURATION_RE.findall(duration))


def _query_steps(rule: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [step for step in rule["data"] if step["datasourceUid"] != "__expr__"]


def _query_step(rule: Mapping[str, Any]) -> dict[str, Any]:
    (step,) = _query_steps(rule)
    return step


def _influxql(rule: Mapping[str, Any]) -> str:
    text: str = _query_step(rule)["model"]["query"]
    return text


@dataclasses.dataclass(frozen=True, slots=True)
class QueryNames:
    """The names one InfluxQL query uses, by role."""

    measurements: frozenset[str]
    fields: frozenset[str]
    group_by: tuple[tuple[str, ...], ...]  # each GROUP BY clause, outermost last


def _names(query: str) -> QueryNames:
    measurements = set(re.findall(r'FROM "(\w+)"', query))
    aliases = set(re.findall(r'AS "(\w+)"', query))
    group_by = tuple(tuple(_QUOTED_RE.findall(clause)) for clause in _GROUP_BY_RE.findall(query))
    tags = {tag for clause in group_by for tag in clause}
    fields = set(_QUOTED_RE.findall(query)) - measurements - aliases - tags
    return QueryNames(frozenset(measurements), frozenset(fields), group_by)


def _kebab(title: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", title.removeprefix("Polca")).lower()


# --- structure ---------------------------------------------------------------------------------


def test_file_is_grafana_alert_rule_provisioning() -> None:
    """apiVersion 1; groups with org, name, folder polca and interval; required rule keys;
    stable unique uids derived from the title; no data is OK, an error is an error."""
    config = _yaml(ALERTS_YAML)
    assert config["apiVersion"] == 1
    assert set(config) == {"apiVersion", "groups"}
    names = [group["name"] for group in config["groups"]]
    assert len(names) == len(set(names)), names
    uids: list[str] = []
    for group in config["groups"]:
        assert group["orgId"] == 1
        assert group["folder"] == "polca"
        interval_s = _seconds(group["interval"])
        assert interval_s % 10 == 0, group["name"]  # Grafana's base evaluation interval
        assert group["rules"], group["name"]
        for rule in group["rules"]:
            assert set(rule) >= RULE_KEYS, (rule.get("title"), RULE_KEYS - set(rule))
            assert rule["uid"] == f"polca-{_kebab(rule['title'])}", rule["title"]
            assert re.fullmatch(r"[a-z0-9-]{1,40}", rule["uid"]), rule["uid"]
            assert rule["noDataState"] == "OK", rule["title"]
            assert rule["execErrState"] == "Error", rule["title"]
            assert _seconds(rule["for"]) % interval_s == 0, rule["title"]
            uids.append(rule["uid"])
    assert len(uids) == len(set(uids)), uids
    assert len(uids) == len(_rules()), "titles must be unique in the folder"


def test_steps_are_one_influxql_query_then_known_expressions() -> None:
    """Query A on the provisioned InfluxDB datasource, raw InfluxQL over ``$timeFilter``; then
    ``__expr__`` steps of known types, each reading an earlier step; the condition is one."""
    uid = _datasource_uid()
    for title, rule in _rules().items():
        ref_ids = [step["refId"] for step in rule["data"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        assert rule["condition"] in ref_ids, title
        query = _query_step(rule)
        assert query["datasourceUid"] == uid, title
        assert query["model"]["datasource"] == {"type": "influxdb", "uid": uid}, title
        assert query["model"]["rawQuery"] is True, title
        assert query["model"]["resultFormat"] == "time_series", title
        assert query["model"]["refId"] == query["refId"], title
        window = query["relativeTimeRange"]
        assert window["from"] > window["to"] >= 0, title
        text = query["model"]["query"]
        assert text.startswith("SELECT "), title
        assert "$timeFilter" in text, title
        # Site-neutral: every WHERE is the time filter only, no tag values baked in.
        assert set(_WHERE_RE.findall(text)) == {"$timeFilter"}, (title, text)
        # A "/ N" turns an increase into a rate: N must be the window.
        for divisor in re.findall(r"\) / (\d+)", text):
            assert int(divisor) == window["from"] - window["to"], title
        seen = {query["refId"]}
        for step in rule["data"]:
            if step is query:
                continue
            problem = _expression_problem(step, seen)
            assert problem is None, f"{title} step {step['refId']}: {problem}"
            seen.add(step["refId"])
        condition = next(step for step in rule["data"] if step["refId"] == rule["condition"])
        assert condition["datasourceUid"] == "__expr__", title
        assert condition is rule["data"][-1], title


def _expression_problem(step: Mapping[str, Any], earlier: set[str]) -> str | None:
    """What is wrong with one ``__expr__`` step, or None."""
    model = step["model"]
    if step["datasourceUid"] != "__expr__":
        return "a second query"
    if model.get("datasource") != {"type": "__expr__", "uid": "__expr__"}:
        return f"datasource {model.get('datasource')}"
    if model.get("refId") != step["refId"]:
        return "model.refId differs"
    kind = model.get("type")
    if kind not in EXPRESSION_TYPES:
        return f"unknown expression type {kind!r}"
    if kind in {"reduce", "threshold"} and model.get("expression") not in earlier:
        return f"reads {model.get('expression')!r}, not an earlier step"
    if kind == "reduce":
        if model.get("reducer") not in REDUCERS:
            return f"reducer {model.get('reducer')!r}"
        if model.get("settings", {}).get("mode", "") not in REDUCE_MODES:
            return f"mode {model['settings']['mode']!r}"
    if kind == "threshold":
        (condition,) = model["conditions"]
        evaluator = condition["evaluator"]
        arity = THRESHOLD_PARAMS.get(evaluator["type"])
        if arity is None:
            return f"threshold type {evaluator['type']!r}"
        params = evaluator["params"]
        if len(params) != arity or not all(isinstance(p, int | float) for p in params):
            return f"threshold params {params}"
    return None


def test_every_prometheus_alert_has_a_grafana_rule_of_the_same_meaning() -> None:
    """Same title, group, severity, ``for`` and runbook text as the Prometheus rule; the
    window of each increase()/rate() is the query's time range."""
    prometheus = _prometheus_rules()
    rules = _rules()
    groups = _group_of()
    assert set(rules) == set(prometheus) - PROMETHEUS_ONLY
    for title, rule in rules.items():
        group, alert = prometheus[title]
        assert groups[title] == group, title
        assert rule["labels"] == alert["labels"], title
        assert rule["annotations"]["runbook"] == alert["annotations"]["runbook"], title
        assert rule["annotations"]["summary"], title
        assert _seconds(rule["for"]) == _seconds(alert.get("for", "0s")), title
        windows = set(re.findall(r"\[(\w+)\]", alert["expr"]))
        expected = _seconds(windows.pop()) if windows else STATE_WINDOW_S
        assert not windows, title
        assert _query_step(rule)["relativeTimeRange"]["from"] == expected, title


def test_queries_name_only_schema_measurements_fields_and_tags() -> None:
    """Each measurement, field and tag a query names is in ``polca.export.schema.SCHEMA``
    (a ``dropped_<reason>`` field matches its pattern), and every GROUP BY of a query
    (subquery and outer) is the same, so no series is merged on the way out."""
    for title, rule in _rules().items():
        names = _names(_influxql(rule))
        assert len(names.measurements) == 1, (title, names.measurements)
        (measurement,) = names.measurements
        schema = SCHEMA.get(measurement)
        assert schema is not None, (title, measurement)
        assert names.fields, title
        for field in names.fields:
            assert schema.field_type(field) is not None, (title, measurement, field)
            assert schema.field_type(field) is not str, (title, field)
        assert names.group_by, title
        assert len(set(names.group_by)) == 1, (title, names.group_by)
        assert set(names.group_by[0]) <= set(schema.tags), (title, names.group_by[0])


def test_schema_check_catches_a_wrong_name() -> None:
    """The name extraction the schema test relies on sees fields, aliases and tags apart."""
    names = _names(
        'SELECT sum("increase") FROM (SELECT non_negative_difference("dropped_topology") AS '
        '"increase" FROM "aggregator" WHERE $timeFilter GROUP BY "site", "instance") WHERE '
        '$timeFilter GROUP BY "site", "instance"'
    )
    assert names == QueryNames(
        frozenset({"aggregator"}),
        frozenset({"dropped_topology"}),
        (("site", "instance"), ("site", "instance")),
    )
    assert SCHEMA["aggregator"].field_type("dropped_topology") is int
    assert SCHEMA["aggregator"].field_type("dropped_") is None
    assert _names('SELECT last("levle") FROM "row" WHERE $timeFilter').fields == {"levle"}
    assert SCHEMA["row"].field_type("levle") is None


def test_queries_group_by_what_the_alert_is_about() -> None:
    """Each alert instance is one series: the query groups by every label the Prometheus
    rule aggregates by (under its InfluxDB tag name), and the annotations use only those
    tags and existing steps."""
    prometheus = _prometheus_rules()
    for title, rule in _rules().items():
        tags = set(_names(_influxql(rule)).group_by[-1])
        by = re.search(r"by \(([^)]*)\)", prometheus[title][1]["expr"])
        assert by is not None, title
        wanted = {PROMETHEUS_TAG.get(label, label) for label in re.split(r",\s*", by[1])}
        assert wanted - NOT_A_TAG <= tags, (title, wanted - tags)
        ref_ids = {step["refId"] for step in rule["data"]}
        for text in rule["annotations"].values():
            assert set(_TEMPLATE_LABEL_RE.findall(text)) <= tags, (title, text)
            assert set(_TEMPLATE_VALUE_RE.findall(text)) <= ref_ids, (title, text)
            # Prometheus's $value; Grafana's is a list of every step, not one number.
            assert not re.search(r"\$value\b(?!s)", text), (title, text)


def test_docs_name_every_rule() -> None:
    """The Grafana README and docs/prometheus.md list the rules and the Prometheus-only one."""
    readme = GRAFANA_README.read_text(encoding="utf-8")
    doc = PROMETHEUS_DOC.read_text(encoding="utf-8")
    assert "## Grafana alert rules" in readme
    assert "provisioning/alerting/polca-alerts.yaml" in readme
    assert "/etc/grafana/provisioning/alerting/" in readme
    for title in _rules():
        assert f"`{title}`" in readme, title
        assert f"`{title}`" in doc, title
    for title in PROMETHEUS_ONLY:
        assert f"`{title}`" in readme
        assert f"`{title}` exists only" in doc


# --- evaluating a rule like Grafana ------------------------------------------------------------


def grafana_query(rule: Mapping[str, Any]) -> str:
    """The InfluxQL Grafana sends for the rule's query step at evaluation time."""
    window = _query_step(rule)["relativeTimeRange"]
    time_filter = f"time > now() - {window['from']}s"
    if window["to"]:
        time_filter += f" AND time < now() - {window['to']}s"
    return render(_influxql(rule).replace("$timeFilter", time_filter), {})


def _frames(server: InfluxDB1Process, influxql: str) -> Frames:
    """The query's series as Grafana's InfluxDB datasource frames them: one per tag set."""
    answer = server.query_raw(influxql)
    assert "error" not in answer, answer
    frames: Frames = {}
    for result in answer["results"]:
        assert "error" not in result, (result["error"], influxql)
        for series in result.get("series", []):
            # Two value columns with the same tags are frames Grafana cannot tell apart
            # ("frame cannot uniquely be identified by its labels").
            assert len(series["columns"]) == 2, (series["columns"], influxql)
            labels = tuple(sorted(series.get("tags", {}).items()))
            assert labels not in frames, (labels, influxql)
            frames[labels] = [
                math.nan if row[1] is None else float(row[1]) for row in series["values"]
            ]
    return frames


_REDUCE: dict[str, Callable[[list[float]], float]] = {
    "last": lambda v: v[-1],
    "max": max,
    "min": min,
    "mean": lambda v: math.fsum(v) / len(v),
}


def reduce(model: Mapping[str, Any], frames: Frames) -> Frames:
    """Grafana's reduce expression: one number per series."""
    mode = model.get("settings", {}).get("mode", "")
    reducer = model["reducer"]
    out: Frames = {}
    for labels, series in frames.items():
        values = series
        if mode == "dropNN":
            values = [v for v in series if not math.isnan(v)]
        elif mode == "replaceNN":
            fill = float(model["settings"]["replaceWithValue"])
            values = [fill if math.isnan(v) else v for v in series]
        elif any(math.isnan(v) for v in series):  # strict: a NaN makes the result NaN
            out[labels] = [math.nan]
            continue
        if reducer == "count":
            out[labels] = [float(len(values))]
        elif reducer == "sum":
            out[labels] = [math.fsum(values)]
        elif reducer not in _REDUCE:
            msg = f"the evaluator has no reducer {reducer!r}"
            raise NotImplementedError(msg)
        else:
            out[labels] = [_REDUCE[reducer](values) if values else math.nan]
    return out


def threshold_holds(evaluator: Mapping[str, Any], value: float) -> bool:
    """Grafana's threshold evaluators; ranges are exclusive, NaN never holds."""
    kind: str = evaluator["type"]
    params = [float(p) for p in evaluator["params"]]
    if kind == "gt":
        return value > params[0]
    if kind == "lt":
        return value < params[0]
    if kind == "within_range":
        return params[0] < value < params[1]
    if kind == "outside_range":
        return value < params[0] or value > params[1]
    msg = f"the evaluator has no threshold type {kind!r}"
    raise NotImplementedError(msg)


def threshold(model: Mapping[str, Any], numbers: Frames) -> Frames:
    """Grafana's threshold expression on reduced numbers: 1 where it holds, else 0."""
    (condition,) = model["conditions"]
    out: Frames = {}
    for labels, values in numbers.items():
        (value,) = values  # a threshold on a whole series is not what these rules do
        out[labels] = [float(threshold_holds(condition["evaluator"], value))]
    return out


def evaluate(server: InfluxDB1Process, rule: Mapping[str, Any]) -> dict[Labels, bool]:
    """Every series the rule's condition yields, and whether it is firing (non-zero)."""
    results: dict[str, Frames] = {}
    for step in rule["data"]:
        model = step["model"]
        if step["datasourceUid"] != "__expr__":
            results[step["refId"]] = _frames(server, grafana_query(rule))
        elif model["type"] == "reduce":
            results[step["refId"]] = reduce(model, results[model["expression"]])
        elif model["type"] == "threshold":
            results[step["refId"]] = threshold(model, results[model["expression"]])
        else:
            msg = f"the evaluator has no {model['type']!r} expression"
            raise NotImplementedError(msg)
    return {
        labels: value != 0 and not math.isnan(value)
        for labels, (value,) in results[rule["condition"]].items()
    }


def test_evaluator_follows_grafana_semantics() -> None:
    """The evaluator's reduce modes and threshold types, which the live test depends on."""
    frames: Frames = {(("node", "n1"),): [1.0, math.nan, 3.0], (("node", "n2"),): [math.nan]}
    last = reduce({"reducer": "last", "settings": {"mode": "dropNN"}}, frames)
    assert last[(("node", "n1"),)] == [3.0]
    assert math.isnan(last[(("node", "n2"),)][0])
    strict = reduce({"reducer": "max"}, frames)
    assert math.isnan(strict[(("node", "n1"),)][0])
    replaced = reduce(
        {"reducer": "sum", "settings": {"mode": "replaceNN", "replaceWithValue": 0}}, frames
    )
    assert replaced[(("node", "n1"),)] == [4.0]
    band = {"type": "within_range", "params": [1.5, 2.5]}
    assert [threshold_holds(band, v) for v in (1.5, 2.0, 2.5)] == [False, True, False]
    assert not threshold_holds({"type": "gt", "params": [0]}, math.nan)
    assert threshold_holds({"type": "outside_range", "params": [0, 1]}, 2.0)
    with pytest.raises(NotImplementedError):
        threshold_holds({"type": "gte", "params": [0]}, 1.0)


# --- a scenario in a real InfluxDB -------------------------------------------------------------

SITE = "dc-alerts"
RECENT_S = (100, 70, 40, 10)  # seconds before now: inside every rule's window
OLD_S = (1500, 1200)  # outside every window (the longest is 10 min)
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Series:
    """One series of the scenario: values at ``RECENT_S`` (and optionally ``OLD_S``)."""

    measurement: str
    tags: Mapping[str, str]
    recent: Mapping[str, Sequence[float]]
    old: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)


def _row(row: str, **recent: Sequence[float]) -> Series:
    return Series("row", {"site": SITE, "row": row}, recent)


def _feed(domain: str, feed: str, up: Sequence[float]) -> Series:
    return Series("power_feed", {"site": SITE, "domain": domain, "feed": feed}, {"up": up})


def _domain(domain: str, measured_w: Sequence[float], capacity_w: Sequence[float]) -> Series:
    tags = {"site": SITE, "domain": domain, "kind": "ups"}
    return Series("power_domain", tags, {"measured_w": measured_w, "capacity_w": capacity_w})


def _node(rack: str, node: str, **recent: Sequence[float]) -> Series:
    return Series("node", {"site": SITE, "row": "r1", "rack": rack, "node": node}, recent)


def _gpu(node: str, index: int, old: Mapping[str, Sequence[float]] | None = None,
         **recent: Sequence[float]) -> Series:  # fmt: skip
    tags = {"site": SITE, "row": "r1", "rack": "k1", "node": node,
            "gpu_uuid": f"GPU-{node}-{index}", "gpu_index": str(index)}  # fmt: skip
    return Series("gpu_health", tags, recent, old or {})


def _brakes(row: str, scope: str, recent: Sequence[float], old: Sequence[float] = ()) -> Series:
    tags = {"site": SITE, "row": row, "scope": scope}
    return Series("control", tags, {"brakes": recent}, {"brakes": old} if old else {})


def _loop(loop: str, severity: Sequence[float]) -> Series:
    tags = {"site": SITE, "loop": loop, "cdu": f"cdu-{loop}"}
    return Series("cooling_loop", tags, {"severity": severity})


def _aggregator(
    instance: str, dropped: Sequence[float], spool_mib: Sequence[float], failures: Sequence[float]
) -> Series:
    tags = {"site": SITE, "instance": instance}
    fields = {"messages_dropped": dropped, "dropped_malformed": dropped,
              "spool_bytes": [v * MIB for v in spool_mib],
              "control_step_failures": failures}  # fmt: skip
    return Series("aggregator", tags, fields)


SCENARIO = (
    # r1 at T2, over budget, its meter distrusted now; r2 at T1 with nodes offline; r3 was
    # at T3 and over budget, its meter distrusted then, trusted again.
    _row("r1", level=[2, 2, 2, 2], power_w=[1050, 1080, 1100, 1100], budget_w=[1000] * 4,
         nodes_offline=[0] * 4, meter_trusted=[1, 1, 0, 0]),
    _row("r2", level=[1] * 4, power_w=[900] * 4, budget_w=[1000] * 4, nodes_offline=[2] * 4,
         meter_trusted=[1] * 4),
    _row("r3", level=[3, 3, 0, 0], power_w=[1200, 1200, 950, 950], budget_w=[1000] * 4,
         nodes_offline=[1, 1, 0, 0], meter_trusted=[0, 0, 1, 1]),
    # r1 on its fallback now; r2 on a lease; r3 was on its fallback, its lease back.
    _row("r1", on_fallback=[0, 0, 1, 1]),
    _row("r2", on_fallback=[0] * 4),
    _row("r3", on_fallback=[1, 1, 0, 0]),
    # Feed B of ups-a tripped; feed A up; ups-b's feed A was down and is back.
    _feed("ups-a", "A", [1] * 4),
    _feed("ups-a", "B", [1, 1, 0, 0]),
    _feed("ups-b", "A", [0, 0, 1, 1]),
    # ups-a over its capacity now; ups-b under it; ups-c's capacity 0 (both feeds down)
    # with its rows drawing; ups-d was over and is under again.
    _domain("ups-a", [500, 700, 700, 700], [600] * 4),
    _domain("ups-b", [500] * 4, [600] * 4),
    _domain("ups-c", [0, 0, 10, 10], [0] * 4),
    _domain("ups-d", [700, 700, 500, 500], [600] * 4),
    # A brake now; a constant counter; a counter reset; a brake 20 minutes ago.
    _brakes("r1", "row", [0, 0, 1, 1], old=[0, 0]),
    _brakes("r1", "rack:k1", [2, 2, 2, 2]),
    _brakes("r2", "row", [5, 0, 0, 0]),
    _brakes("r3", "row", [1, 1, 1, 1], old=[0, 1]),
    # n1 at fail-safe with NVML errors; n2 stale, its error counter reset; n3 recovered,
    # and 3 errors (not more than 3). n1 implausible now, n2 no longer; n1 over its
    # admission rate (600 refused in 5 min: 2/s), n2 under it, n3's counter reset.
    _node("k1", "n1", fail_safe=[1] * 4, stale=[0] * 4, gpu_errors=[0, 2, 4, 6],
          implausible=[0, 0, 1, 1], rate_limited=[0, 200, 400, 600]),
    _node("k1", "n2", fail_safe=[0] * 4, stale=[1] * 4, gpu_errors=[10, 0, 1, 2],
          implausible=[1, 1, 0, 0], rate_limited=[0, 10, 20, 30]),
    _node("k2", "n3", fail_safe=[1, 1, 0, 0], stale=[1, 1, 0, 0], gpu_errors=[0, 1, 2, 3],
          implausible=[0] * 4, rate_limited=[1000, 0, 5, 10]),
    # An XID now; uncorrected ECC errors now; a failed row remap; XIDs and ECC errors from
    # before the window, and a failed remap that a reset cleared.
    _gpu("n1", 0, xid_errors=[0, 0, 1, 1], ecc_uncorrected_volatile=[0] * 4,
         row_remap_failure=[0] * 4),
    _gpu("n1", 1, xid_errors=[3] * 4, ecc_uncorrected_volatile=[0, 0, 2, 2],
         row_remap_failure=[0] * 4),
    _gpu("n2", 0, old={"xid_errors": [0, 3]}, xid_errors=[3] * 4,
         ecc_uncorrected_volatile=[5] * 4, row_remap_failure=[0, 0, 1, 1]),
    _gpu("n2", 1, old={"ecc_uncorrected_volatile": [0, 7]}, xid_errors=[0] * 4,
         ecc_uncorrected_volatile=[7] * 4, row_remap_failure=[1, 1, 0, 0]),
    # Degraded; escalated to critical; critical that de-escalated to a warning.
    _loop("L1", [2] * 4),
    _loop("L2", [2, 2, 3, 3]),
    _loop("L3", [3, 3, 1, 1]),
    # 60 drops in 5 min (0.2/s) and a full spool; 15 drops (0.05/s), a spool that shrank;
    # an aggregator restart (counter reset) with 10 drops after it. agg-1's control steps
    # fail now; agg-2's failed once, long ago; agg-3 restarted after failures.
    _aggregator("agg-1", [0, 20, 40, 60], [300] * 4, [0, 0, 1, 2]),
    _aggregator("agg-2", [0, 5, 10, 15], [100, 300, 100, 100], [3] * 4),
    _aggregator("agg-3", [500, 0, 5, 10], [0] * 4, [7, 0, 0, 0]),
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """What a rule must do on the scenario: ``key`` names the tags that tell its series
    apart; each of ``fires`` and ``silent`` is a tuple of their values."""

    key: tuple[str, ...]
    fires: frozenset[tuple[str, ...]]
    silent: frozenset[tuple[str, ...]]


def _case(key: str, fires: set[str], silent: set[str]) -> Case:
    """A case keyed by one tag, or by ``node/gpu_index`` for GPUs."""
    keys = tuple(key.split("/"))
    return Case(
        keys,
        frozenset(tuple(v.split("/")) for v in fires),
        frozenset(tuple(v.split("/")) for v in silent),
    )


CASES = {
    "PolcaRowAtT2": _case("row", {"r1"}, {"r2", "r3"}),
    "PolcaRowPowerOverBudget": _case("row", {"r1"}, {"r2", "r3"}),
    "PolcaBrake": Case(
        ("row", "scope"),
        frozenset({("r1", "row")}),
        frozenset({("r1", "rack:k1"), ("r2", "row"), ("r3", "row")}),
    ),
    "PolcaNodeFailSafe": _case("node", {"n1"}, {"n2", "n3"}),
    "PolcaNodeStale": _case("node", {"n2"}, {"n1", "n3"}),
    "PolcaNodesOffline": _case("row", {"r2"}, {"r1", "r3"}),
    "PolcaRowMeterDistrusted": _case("row", {"r1"}, {"r2", "r3"}),
    "PolcaAgentGpuErrors": _case("node", {"n1"}, {"n2", "n3"}),
    "PolcaGpuXid": _case("node/gpu_index", {"n1/0"}, {"n1/1", "n2/0", "n2/1"}),
    "PolcaGpuMemoryErrors": _case("node/gpu_index", {"n1/1", "n2/0"}, {"n1/0", "n2/1"}),
    "PolcaCoolingDegraded": _case("loop", {"L1"}, {"L2", "L3"}),
    "PolcaCoolingCritical": _case("loop", {"L2"}, {"L1", "L3"}),
    "PolcaIntakeDrops": _case("instance", {"agg-1"}, {"agg-2", "agg-3"}),
    "PolcaSpoolFilling": _case("instance", {"agg-1"}, {"agg-2", "agg-3"}),
    "PolcaControlStepFailing": _case("instance", {"agg-1"}, {"agg-2", "agg-3"}),
    "PolcaNodeImplausible": _case("node", {"n1"}, {"n2", "n3"}),
    "PolcaNodeRateLimited": _case("node", {"n1"}, {"n2", "n3"}),
    "PolcaFeedDown": Case(
        ("domain", "feed"),
        frozenset({("ups-a", "B")}),
        frozenset({("ups-a", "A"), ("ups-b", "A")}),
    ),
    "PolcaDomainOverCapacity": _case("domain", {"ups-a", "ups-c"}, {"ups-b", "ups-d"}),
    "PolcaRowOnFallback": _case("row", {"r1"}, {"r2", "r3"}),
}


def scenario_points(now_ms: int) -> list[Point]:
    """The scenario as points of polca's schema, built by its own point builder."""
    out: list[Point] = []
    for series in SCENARIO:
        for offsets, columns in ((RECENT_S, series.recent), (OLD_S, series.old)):
            for i, seconds_ago in enumerate(offsets):
                fields = {name: values[i] for name, values in columns.items()}
                if fields:
                    ts_ns = (now_ms - seconds_ago * 1000) * 1_000_000
                    out.append(make_point(series.measurement, ts_ns=ts_ns, tags=series.tags,
                                          fields=fields))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def alert_scenario(grafana_influxdb: InfluxDB1Process) -> InfluxDB1Process:
    """This module's InfluxDB holding the scenario, its newest points 10 s old."""
    points = scenario_points(math.floor(time.time() * 1000))
    grafana_influxdb.write(encode_lines(points, "ms"))
    return grafana_influxdb


def test_cases_cover_every_rule() -> None:
    """Each rule has a case that must fire and series that must stay silent."""
    assert set(CASES) == set(_rules())
    for title, case in CASES.items():
        assert case.fires, title
        assert case.silent, title
        assert not case.fires & case.silent, title


def test_every_rule_query_runs_and_fills_its_column(alert_scenario: InfluxDB1Process) -> None:
    """Each query, as Grafana sends it, runs on InfluxDB 1.x with data in every series and
    each GROUP BY tag set (the dashboards' checker)."""
    problems = [
        f"{title}: {problem}"
        for title, rule in _rules().items()
        for problem in check_query(alert_scenario, grafana_query(rule), {})
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("title", sorted(CASES))
def test_rule_fires_on_its_cases_only(alert_scenario: InfluxDB1Process, title: str) -> None:
    """The rule's query, reduce and threshold fire on exactly the series meant to raise it,
    and evaluate (not only miss) those that must stay silent."""
    rule, case = _rules()[title], CASES[title]
    states = evaluate(alert_scenario, rule)
    by_key = {tuple(dict(labels)[tag] for tag in case.key): firing
              for labels, firing in states.items()}  # fmt: skip
    assert len(by_key) == len(states), "the case's key does not tell the series apart"
    assert set(by_key) == case.fires | case.silent, sorted(by_key)
    assert {key for key, firing in by_key.items() if firing} == case.fires
    for labels in states:
        assert dict(labels)["site"] == SITE, labels
