"""The shipped Prometheus alert rules: valid, unit-tested by promtool, one manifest."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from polca.export.prometheus import CLOCK_EVENT_FAMILY, DROPPED_FAMILY, FAMILIES
from tests.prometheus import PROMTOOL
from tests.services import require_binary

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = RULES_DIR / "polca-rules.yml"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    require_binary(
        PROMTOOL, needed_by="the alert rules are checked by promtool", package="prometheus"
    )
    return subprocess.run(
        [str(PROMTOOL), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=RULES_DIR,
    )


def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 22 rules found" in result.stdout


def test_promtool_unit_tests_fire_and_stay_silent() -> None:
    """Every alert has a case where it fires; several have one where it must not."""
    result = _promtool("test", "rules", "polca-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    tests = yaml.safe_load((RULES_DIR / "polca-rules.test.yml").read_text(encoding="utf-8"))
    cases = [case for test in tests["tests"] for case in test["alert_rule_test"]]
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts
    assert sum(1 for c in cases if not c["exp_alerts"]) >= 3


def test_every_rule_has_a_runbook_and_uses_served_metrics() -> None:
    """A runbook line per alert, and only metric names the Prometheus sink serves."""
    served = {f.name for f in FAMILIES} | {CLOCK_EVENT_FAMILY, DROPPED_FAMILY}
    for group in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]:
        for rule in group["rules"]:
            assert len(rule["annotations"]["runbook"]) > 40, rule["alert"]
            assert rule["labels"]["severity"] in {"warning", "critical"}
            names = set(re.findall(r"\bpolca_[a-z0-9_]+", rule["expr"]))
            assert names, rule["alert"]
            assert names <= served, (rule["alert"], names - served)


def test_the_manifest_holds_the_same_rules() -> None:
    manifest = yaml.safe_load((RULES_DIR / "polca-rules.k8s.yaml").read_text(encoding="utf-8"))
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
