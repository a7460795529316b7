"""Settings of the site controller, ``polca site run``: its tree, its pace, its leases, HA.

Read like every polca process's settings (``settings.load_settings_as``): the YAML file
named by ``--config``, ``POLCA_*`` environment variables, secrets from files or systemd
credentials. ``tree_file`` names the site file (``polca site check`` validates it);
``deploy/site/site.example.yaml`` and ``deploy/site/controller.example.yaml`` are complete
examples, ``docs/power-tree.md`` says how they fit. ``influx`` and ``metrics`` (the shared
``metrics.address``) are the sinks of the tree's points (``sitectl/points.py``), both off
unless set, as the aggregator's.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Self

from pydantic import Field, model_validator

from polca.coord.config import HaSettings
from polca.settings import (
    DEFAULT_TOPIC_ROOT,
    TOPIC_SEGMENT,
    DarkPollsDown,
    InfluxSettings,
    ProcessSettings,
    SiteName,
    TopicRoot,
)

__all__ = ["SiteSettings"]


class SiteSettings(ProcessSettings):
    """Settings of a ``polca site run`` process (YAML via ``--config``, ``POLCA_*`` env)."""

    topic_root: TopicRoot = DEFAULT_TOPIC_ROOT
    site: SiteName = "site"
    instance: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0] or "site",
        pattern=TOPIC_SEGMENT,
        description="This site controller's name: the budgets' issuer, its client id.",
    )
    tree_file: Path = Field(
        Path("/etc/polca/site.yaml"), description="The site file: the power tree above the rows."
    )
    interval_s: float = Field(
        1.0, gt=0, le=60, description="Allocation period (and the budgets' publish period)."
    )
    lease_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How long a row may run on a budget without a newer one: longer than a "
        "standby's takeover, so rows hold their budgets through a failover.",
    )
    dark_polls_down: DarkPollsDown = 3
    summary_max_age_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="A row summary older than this is stale: its demand is kept, and the "
        "row is listed as stale in the site's report.",
    )
    meter_topics: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(
        (),
        max_length=64,
        description="Topic filters of the meters to read besides the default "
        "{topic_root}/{site}/+/meter (a meter group configured with its own topic).",
    )
    ha: HaSettings = Field(
        default_factory=HaSettings,
        description="Active/standby site controllers, elected on etcd: only the leader "
        "publishes budgets (each carries its term).",
    )
    influx: InfluxSettings = Field(
        default_factory=InfluxSettings,
        description="The time-series database the leader writes the tree's points to "
        "(power_domain, power_feed, row_budget; docs/influxdb.md); off unless influx.url "
        "is set.",
    )
    state_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("STATE_DIRECTORY", "/var/lib/polca-site")),
        description="Where the InfluxDB spool lives by default ($STATE_DIRECTORY).",
    )

    @property
    def client_id(self) -> str:
        """The broker client id: ``mqtt.client_id``, else ``polca-site-<site>-<instance>``."""
        return self.mqtt.client_id or f"polca-site-{self.site}-{self.instance}"

    @model_validator(mode="after")
    def _leases(self) -> Self:
        if self.lease_s < 2 * self.interval_s:
            msg = (
                f"lease_s ({self.lease_s:g} s) must be at least twice interval_s "
                f"({self.interval_s:g} s): a row must get a new budget before its lease ends"
            )
            raise ValueError(msg)
        if self.ha.enabled and self.ha.lease_ttl_s * 2 > self.lease_s:
            msg = (
                f"ha.lease_ttl_s ({self.ha.lease_ttl_s:g} s) must be at most half of lease_s "
                f"({self.lease_s:g} s): a standby must lead before the rows' leases end"
            )
            raise ValueError(msg)
        return self
