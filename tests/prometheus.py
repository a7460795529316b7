"""A real Prometheus for the tests (Debian's ``prometheus``), scraping given targets.

Started on a free loopback port with its storage under the work directory and a scrape
interval of 1 s, so a test sees a running daemon's metrics within seconds. ``query`` runs
PromQL through the HTTP API and returns the result vector.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.services import ServiceProcess, http_request, require_binary

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")


class PrometheusProcess(ServiceProcess):
    """Prometheus scraping ``targets`` (host:port) every second."""

    name = "prometheus"
    start_timeout_s = 30.0

    def __init__(
        self, workdir: Path, *, targets: list[str], rule_files: list[Path] | None = None
    ) -> None:
        require_binary(
            PROMETHEUS, needed_by="the metrics tests need a real Prometheus", package="prometheus"
        )
        super().__init__(workdir)
        self.config_path = workdir / "prometheus.yml"
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in rule_files or []],
            "scrape_configs": [
                {"job_name": "polca", "static_configs": [{"targets": targets}]},
            ],
        }
        self.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")

    @property
    def url(self) -> str:
        """The HTTP API's base URL."""
        return f"http://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        return [
            str(PROMETHEUS),
            f"--config.file={self.config_path}",
            f"--web.listen-address={self.host}:{self.port}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            "--log.level=warn",
        ]

    def _ready(self) -> bool:
        status, _ = http_request("GET", f"{self.url}/-/ready", timeout_s=0.5)
        return status == 200

    def api(self, path: str) -> dict[str, Any]:
        """One GET of the HTTP API (``/api/v1/...``): its ``data`` (fails the test on an
        API error)."""
        _, raw = http_request("GET", f"{self.url}{path}", timeout_s=5)
        body = json.loads(raw)
        if body.get("status") != "success":
            pytest.fail(f"{path}: {body}")
        data: dict[str, Any] = body["data"]
        return data

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` now."""
        result: list[dict[str, Any]] = self.api(
            f"/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        )["result"]
        return result

    def wait_for(self, promql: str, *, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """The vector of ``promql`` once it is not empty."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                return result
            time.sleep(0.25)
        pytest.fail(f"PromQL {promql!r} stayed empty for {timeout_s} s:\n{self.log_tail()}")
