"""A real ``polca aggregator`` process for end-to-end tests, with its topology and policy.

The process plumbing (start, signals, the JSON log) is ``rig.JsonLogProcess``, shared with
the agent's rig.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from tests.integration.rig import ROW, SITE, Broker, JsonLogProcess, mqtt_config


class AggregatorProcess(JsonLogProcess):
    """One aggregator process under test."""

    command = "aggregator"

    def __init__(
        self,
        workdir: Path,
        *,
        broker: Broker,
        policy: Path,
        racks: dict[str, list[str]],
        budget_w: float,
        lease_s: float | None = 3.0,
        interval_s: float = 0.2,
        meter: bool = True,
        extra: dict[str, Any] | None = None,
        node_fields: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """``node_fields``: more topology fields per node name (``gpus``, ``nameplate_w``);
        ``lease_s`` None: the default (``AggregatorSettings.lease_s``)."""
        super().__init__(workdir, policy=policy)
        fields = node_fields or {}
        self.meter_topic = f"polca/v1/{SITE}/{ROW}/meter"
        config: dict[str, Any] = {
            "site": SITE,
            "instance": "agg1",
            "policy_file": str(self.policy_path),
            "state_dir": str(workdir / "state"),
            "mqtt": mqtt_config(broker),
            "control": {
                "interval_s": interval_s,
                **({"lease_s": lease_s} if lease_s is not None else {}),
                "stale_after_s": 1.5,
                "warmup_s": 1.0,
                "trend_window_s": 2.0,
                # ... and it repeats one figure while the agents cap: not a hung PDU card.
                "meter_frozen_readings": 100_000,
            },
            "rows": [
                {
                    "name": ROW,
                    "budget_w": budget_w,
                    # The probe's meter is a figure of the test's, not a device: the row may
                    # read up to twice its budget (beyond what its few fake GPUs can draw).
                    **(
                        {
                            "meter_topic": self.meter_topic,
                            "meter_max_age_s": 2.0,
                            "meter_max_w": 2 * budget_w,
                        }
                        if meter
                        else {}
                    ),
                    "racks": [
                        {
                            "name": rack,
                            "nodes": [
                                {"name": n, "non_gpu_w": 500.0, **fields.get(n, {})} for n in nodes
                            ],
                        }
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
        self._write_config(config)

    def stop(self) -> int:
        """SIGTERM and wait; the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout_s=20)
