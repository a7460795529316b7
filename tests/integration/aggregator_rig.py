"""A real ``polca aggregator`` process for end-to-end tests, with its topology and policy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.integration.rig import ROW, SITE
from tests.mqtt_broker import MosquittoProcess


class AggregatorProcess:
    """One aggregator process under test."""

    def __init__(
        self,
        workdir: Path,
        *,
        broker: MosquittoProcess,
        policy: Path,
        racks: dict[str, list[str]],
        budget_w: float,
        lease_s: float = 3.0,
        interval_s: float = 0.2,
        meter: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.policy_path = workdir / "policy.yaml"
        if not self.policy_path.exists():
            self.policy_path.write_text(policy.read_text(encoding="utf-8"), encoding="utf-8")
        self.log_path = workdir / "aggregator.log"
        self.meter_topic = f"polca/v1/{SITE}/{ROW}/meter"
        config: dict[str, Any] = {
            "site": SITE,
            "instance": "agg1",
            "policy_file": str(self.policy_path),
            "state_dir": str(workdir / "state"),
            "mqtt": {
                "host": broker.host,
                "port": broker.port,
                "reconnect_min_s": 0.05,
                "reconnect_max_s": 0.5,
                "keepalive_s": 5,
            },
            "control": {
                "interval_s": interval_s,
                "lease_s": lease_s,
                "stale_after_s": 1.5,
                "warmup_s": 1.0,
                "trend_window_s": 2.0,
            },
            "rows": [
                {
                    "name": ROW,
                    "budget_w": budget_w,
                    **({"meter_topic": self.meter_topic, "meter_max_age_s": 2.0} if meter else {}),
                    "racks": [
                        {"name": rack, "nodes": [{"name": n, "non_gpu_w": 500.0} for n in nodes]}
                        for rack, nodes in racks.items()
                    ],
                }
            ],
            "logging": {"level": "debug", "format": "json"},
        }
        for key, value in (extra or {}).items():
            if isinstance(value, dict):
                config.setdefault(key, {}).update(value)
            else:
                config[key] = value
        self.config_path = workdir / "aggregator.yaml"
        self.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the aggregator (logs append to aggregator.log)."""
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "polca", "aggregator", "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> int:
        """SIGTERM and wait."""
        assert self.process is not None
        self.process.terminate()
        return self.process.wait(timeout=20)

    def logs(self) -> list[dict[str, Any]]:
        """Every JSON log line so far."""
        if not self.log_path.exists():
            return []
        out = []
        for raw in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(raw)
                if isinstance(entry, dict):
                    out.append(entry)
        return out

    async def wait_log(
        self,
        event: str,
        *,
        timeout_s: float = 15.0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> dict[str, Any]:
        """The first log line with this event (and matching ``where``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for entry in self.logs():
                if entry.get("event") == event and (where is None or where(entry)):
                    return entry
            await asyncio.sleep(0.05)
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        msg = f"no {event!r} aggregator log line within {timeout_s} s; log:\n{text[-4000:]}"
        raise AssertionError(msg)
