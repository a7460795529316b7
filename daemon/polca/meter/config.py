"""Settings of ``polca meter``: MQTT, logging, site, period, and each row's power sources.

Read like every polca process's settings (``polca.settings.load_settings_as``): the YAML
file named by ``--config``, ``POLCA_*`` environment variables, secrets from files or
systemd credentials (an SNMP community, SNMPv3 keys and Redfish passwords are never in
the YAML: each source names a file or a credential). ``deploy/meter.example.yaml`` is a
complete example; ``docs/facility.md`` says how to point it at a site's PDUs.
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polca.meter.modbus import ModbusMeterConfig
from polca.meter.redfish import RedfishMeterConfig
from polca.meter.snmp import SnmpSourceConfig
from polca.settings import DEFAULT_TOPIC_ROOT, TOPIC_SEGMENT, ProcessSettings, SiteName, TopicRoot

__all__ = ["MeterRowConfig", "MeterSettings", "SourceConfig"]

SourceConfig = Annotated[
    SnmpSourceConfig | RedfishMeterConfig | ModbusMeterConfig, Field(discriminator="protocol")
]
"""One power source: ``protocol: snmp``, ``redfish`` or ``modbus``."""


class MeterRowConfig(BaseModel):
    """One row: its power is the sum of its sources."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    row: str = Field(pattern=TOPIC_SEGMENT, description="Row name (topic segment).")
    topic: str | None = Field(
        None,
        max_length=256,
        description="Topic to publish on (default {topic_root}/{site}/{row}/meter; the "
        "aggregator's rows[].meter_topic must match).",
    )
    sources: tuple[SourceConfig, ...] = Field(
        min_length=1, max_length=64, description="PDUs, circuits or meters whose sum is the row."
    )

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            msg = f"row {self.row}: source names must be unique, got {names}"
            raise ValueError(msg)
        return self


class MeterSettings(ProcessSettings):
    """Settings of a ``polca meter`` process (YAML via ``--config``, ``POLCA_*`` env)."""

    topic_root: TopicRoot = DEFAULT_TOPIC_ROOT
    site: SiteName = "site"
    interval_s: float = Field(1.0, gt=0, le=3600, description="Poll (and publish) period.")
    read_timeout_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Bound on one source's read; default 80% of interval_s. A source "
        "slower than this counts as failed (timeout) and its row's reading as partial.",
    )
    stats_every_s: float = Field(
        60.0, gt=0, le=86_400, description="Period of the meter_rounds log line (round times)."
    )
    rows: tuple[MeterRowConfig, ...] = Field(
        (), max_length=1024, description="The rows and their power sources."
    )

    @model_validator(mode="after")
    def _unique_rows(self) -> Self:
        names = [r.row for r in self.rows]
        if len(set(names)) != len(names):
            msg = f"rows must be unique, got {names}"
            raise ValueError(msg)
        return self

    @property
    def read_bound_s(self) -> float:
        """The bound on one source's read."""
        return self.read_timeout_s if self.read_timeout_s is not None else 0.8 * self.interval_s

    @property
    def client_id(self) -> str:
        """The broker client id: ``mqtt.client_id``, else ``polca-meter-<site>-<first row>``.

        Two meter processes of one site (one per row, as with a broker user per row's
        meter) read disjoint rows, so their first rows differ and neither evicts the
        other's session; a process of no rows is ``polca-meter-<site>``.
        """
        first_row = "".join(f"-{row.row}" for row in self.rows[:1])
        return self.mqtt.client_id or f"polca-meter-{self.site}{first_row}"
