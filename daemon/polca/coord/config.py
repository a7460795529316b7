"""The settings of an election on etcd, shared by the aggregator and the site controller.

Every process that runs active/standby (``polca aggregator``, ``polca site``) has an ``ha``
section of this shape; ``coord/etcd.py`` ``elector_for`` builds its campaign from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from polca.settings import TOPIC_SEGMENT, read_secret

__all__ = ["HaSettings"]


class HaSettings(BaseModel):
    """Active/standby instances of one process, elected on etcd (docs/ha.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    etcd_endpoints: tuple[str, ...] = Field(
        (),
        description="etcd client URLs (http:// or https://); empty: no election, this "
        "aggregator controls its rows alone.",
    )
    shard: str | None = Field(
        None,
        pattern=TOPIC_SEGMENT,
        description="The shard's name: every instance configured for the same rows uses the "
        "same one; default: the row names joined by '+'.",
    )
    peers: tuple[str, ...] = Field(
        (),
        description="The other instances of the shard: their control messages are tracked "
        "(a standby stays warm), never reported as foreign.",
    )
    key_prefix: str = Field("polca/v1/leader", description="etcd key prefix of the election.")
    lease_ttl_s: float = Field(
        2.0,
        ge=1,
        le=30,
        description="etcd lease of the leader: a dead leader is replaced this long after its "
        "last keepalive (plus one campaign); must stay well inside control.lease_s.",
    )
    campaign_interval_s: float = Field(
        0.25, gt=0, le=10, description="How often a standby tries to take the lead."
    )
    request_timeout_s: float = Field(
        0.5, gt=0, le=10, description="Each etcd request's timeout (per endpoint)."
    )
    username: str | None = Field(None, description="etcd user (etcd authentication enabled).")
    password: SecretStr | None = Field(
        None,
        description="etcd password. Only from POLCA_HA__PASSWORD, password_file or the "
        "ha_password systemd credential; refused in the YAML file.",
    )
    password_file: Path | None = Field(None, description="File holding the etcd password.")
    tls_ca_file: Path | None = Field(None, description="CA bundle to verify etcd with (https).")
    tls_cert_file: Path | None = Field(None, description="Client certificate for etcd.")
    tls_key_file: Path | None = Field(None, description="Client key for etcd.")

    @property
    def enabled(self) -> bool:
        """Whether this aggregator campaigns (etcd endpoints are configured)."""
        return bool(self.etcd_endpoints)

    def secret(self) -> str | None:
        """The etcd password: the setting, or the file / systemd credential."""
        if self.password is not None:
            return self.password.get_secret_value()
        if self.username is None:
            return None
        return read_secret(self.password_file, "ha_password")

    @model_validator(mode="after")
    def _urls(self) -> Self:
        for url in self.etcd_endpoints:
            if not url.startswith(("http://", "https://")):
                msg = f"etcd endpoint {url!r} must start with http:// or https://"
                raise ValueError(msg)
        return self
