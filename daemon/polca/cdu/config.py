"""Settings of a ``polca cdu`` process: MQTT, logging, site, period, and the CDU polled
(over Modbus TCP or Redfish).

Read like every polca process's settings (``polca.settings.load_settings_as``): the YAML
file named by ``--config``, ``POLCA_*`` environment variables, secrets from files or
systemd credentials. ``deploy/cdu-modbus.example.yaml`` is a complete example.
"""

from __future__ import annotations

from pydantic import Field

from polca.cdu.redfish import RedfishCduConfig
from polca.cdu.registers import ModbusCduConfig
from polca.settings import DEFAULT_TOPIC_ROOT, ProcessSettings, SiteName, TopicRoot

__all__ = ["CduSettings"]


class CduSettings(ProcessSettings):
    """Settings of a ``polca cdu`` process (YAML via ``--config``, ``POLCA_*`` env)."""

    topic_root: TopicRoot = DEFAULT_TOPIC_ROOT
    site: SiteName = "site"
    interval_s: float = Field(1.0, gt=0, le=3600, description="Publish (and poll) period.")
    modbus: ModbusCduConfig | None = Field(
        None, description="The CDU and its register map (polca cdu modbus)."
    )
    redfish: RedfishCduConfig | None = Field(
        None, description="The CDU and its Redfish service (polca cdu redfish)."
    )
