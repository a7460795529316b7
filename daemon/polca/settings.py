"""Settings of every polca process, grouped by concern, with a documented default each.

Sources, strongest first: keyword arguments (the CLI), ``POLCA_*`` environment variables
(nested with ``__``, e.g. ``POLCA_MQTT__HOST``), the YAML file named by ``--config`` or
``POLCA_CONFIG``, then secret files. Secrets (the MQTT password) never come from the YAML:
they come from ``POLCA_MQTT__PASSWORD``, ``mqtt.password_file``, or a systemd credential
named ``mqtt_password`` in ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=``).

``docs/configuration.md`` is generated from these models (``polca config docs``) and a test
keeps it in sync.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

_TOPIC_SEGMENT = r"^[A-Za-z0-9_.-]+$"
SettingsT = TypeVar("SettingsT", bound="ProcessSettings")


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MqttSettings(_Group):
    """The MQTT broker connection."""

    host: str = Field("127.0.0.1", description="Broker host name or address.")
    port: int = Field(1883, ge=1, le=65535, description="Broker TCP port (8883 for TLS).")
    username: str | None = Field(None, description="User name; none for anonymous access.")
    password: SecretStr | None = Field(
        None,
        description="Password. Only from POLCA_MQTT__PASSWORD, password_file or the "
        "mqtt_password systemd credential; refused in the YAML file.",
    )
    password_file: Path | None = Field(
        None, description="File holding the password (first line; trailing newline ignored)."
    )
    client_id: str | None = Field(
        None, description="MQTT client identifier; defaults to polca-<role>-<node>."
    )
    protocol: Literal["3.1.1", "5"] = Field(
        "3.1.1", description="MQTT protocol version; 3.1.1 works with every broker."
    )
    tls: bool = Field(False, description="Connect with TLS.")
    tls_ca_file: Path | None = Field(None, description="CA bundle to verify the broker with.")
    tls_cert_file: Path | None = Field(None, description="Client certificate for mutual TLS.")
    tls_key_file: Path | None = Field(None, description="Client key for mutual TLS.")
    tls_insecure: bool = Field(False, description="Skip the broker host name check (testing only).")
    keepalive_s: int = Field(15, ge=5, le=3600, description="MQTT keepalive interval.")
    connect_timeout_s: float = Field(10.0, gt=0, description="Timeout of each MQTT operation.")
    reconnect_min_s: float = Field(
        0.5, ge=0, description="First reconnect delay; doubles per failure, with jitter."
    )
    reconnect_max_s: float = Field(30.0, ge=0, description="Largest reconnect delay.")
    outbox_size: int = Field(
        1000,
        ge=1,
        description="Messages held while the broker is unreachable; the oldest are dropped "
        "(and counted) beyond this.",
    )
    inbox_size: int = Field(
        1000, ge=1, description="Received messages queued for processing; oldest dropped."
    )


class TopicSettings(_Group):
    """Where this node sits in the site: the segments of its MQTT topics."""

    root: str = Field("polca/v1", description="Topic root, including the schema version.")
    site: str = Field("site", pattern=_TOPIC_SEGMENT, description="Site name.")
    row: str = Field("row1", pattern=_TOPIC_SEGMENT, description="Row (power domain) name.")
    rack: str = Field("rack1", pattern=_TOPIC_SEGMENT, description="Rack name.")
    node: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0] or "node",
        description="Node name; defaults to the short host name.",
    )

    @field_validator("node")
    @classmethod
    def _node_segment(cls, value: str) -> str:
        cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in value)
        if not cleaned:
            msg = "node name must not be empty"
            raise ValueError(msg)
        return cleaned


class GpuSettings(_Group):
    """The GPU backend."""

    backend: Literal["nvml", "simulated"] = Field(
        "nvml", description="nvml for real GPUs, simulated for the built-in GPU model."
    )
    simulated_count: int = Field(8, ge=1, le=64, description="GPUs of the simulated backend.")
    simulated_model: str = Field(
        "H100-SXM", description="Simulated GPU model preset (A100-SXM4, H100-SXM, H200-SXM)."
    )
    simulated_load: str = Field(
        "inference",
        description="Simulated load profile: idle, constant, inference, ramp or square.",
    )
    simulated_seed: int = Field(0, description="Seed of the simulated load and noise.")
    call_timeout_s: float = Field(
        2.0, gt=0, description="A GPU call taking longer than this is reported as stuck."
    )


class AgentSettings(_Group):
    """The node agent's control loop."""

    sample_interval_s: float = Field(0.1, gt=0, description="GPU sampling period (10 Hz).")
    publish_interval_s: float = Field(
        1.0, gt=0, description="Telemetry period: one message per node per interval."
    )
    policy_file: Path = Field(
        Path("/etc/polca/policy.yaml"), description="Node policy file (hot reloaded)."
    )
    policy_reload_debounce_s: float = Field(
        0.5, ge=0, description="Wait this long after a file change before reloading."
    )
    state_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("STATE_DIRECTORY", "/var/lib/polca")),
        description="Where the original GPU settings are saved before the first write "
        "(systemd's $STATE_DIRECTORY when set).",
    )
    observe_only: bool = Field(
        False, description="Read and publish, never write to the GPUs (no privilege needed)."
    )
    startup_grace_s: float = Field(
        30.0,
        ge=0,
        description="How long the agent waits for its first control message before the "
        "policy's fail-safe caps apply.",
    )
    stop_timeout_s: float = Field(
        5.0, gt=0, description="Bound on restoring GPU settings at shutdown."
    )
    reassert: bool = Field(
        True, description="Re-apply caps that something else changed, with an event."
    )
    accept_remote_policy: bool = Field(
        True,
        description="Apply the node policy the aggregator publishes (validated again here, "
        "kept as a last good copy in state_dir); it then takes precedence over policy_file.",
    )


class InfluxSettings(_Group):
    """The time-series database the aggregator writes to (InfluxDB or compatible)."""

    url: str | None = Field(
        None, description="Base URL such as http://127.0.0.1:8086; none disables writing."
    )
    api: Literal["v2", "v1"] = Field(
        "v2",
        description="v2: /api/v2/write (InfluxDB 1.8+, 2.x, 3.x, VictoriaMetrics); "
        "v1: /write (InfluxDB 1.x).",
    )
    org: str = Field("-", description="v2 organisation (InfluxDB 1.8 and 3.x ignore it).")
    bucket: str = Field("polca", description="v2 bucket (database/retention for 1.8).")
    database: str = Field("polca", description="v1 database.")
    retention_policy: str | None = Field(None, description="v1 retention policy.")
    username: str | None = Field(None, description="v1 user name.")
    token_file: Path | None = Field(
        None,
        description="File holding the v2 token or the v1 password; or the influx_token "
        "systemd credential, or POLCA_INFLUX__TOKEN.",
    )
    token: SecretStr | None = Field(None, description="Token; refused in the YAML file.")
    batch_size: int = Field(5000, ge=1, description="Points per write request.")
    flush_interval_s: float = Field(1.0, gt=0, description="Longest wait before a write.")
    max_buffer_points: int = Field(
        200_000, ge=1, description="Points held in memory; beyond, spooled to disk."
    )
    spool_dir: Path | None = Field(
        None,
        description="Where points wait during a database outage; none keeps them in "
        "memory only (bounded by max_buffer_points).",
    )
    spool_max_mb: float = Field(
        512.0, gt=0, description="Spool bound; beyond it the oldest points are dropped."
    )
    timeout_s: float = Field(10.0, gt=0, description="Timeout of one write request.")
    retry_min_s: float = Field(0.5, ge=0, description="First retry delay (doubles, jitter).")
    retry_max_s: float = Field(30.0, ge=0, description="Largest retry delay.")
    gpu_every_s: float = Field(
        1.0,
        gt=0,
        description="Downsampling of per-GPU series: write one point per GPU at most this "
        "often (node, rack and row series are written every interval).",
    )


class LoggingSettings(_Group):
    """Structured logging."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Level.")
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a terminal, JSON lines otherwise (journald)."
    )


class ProcessSettings(BaseSettings):
    """What every polca process reads the same way: sources, MQTT secrets, logging."""

    model_config = SettingsConfigDict(
        env_prefix="POLCA_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        yaml_file=None,
    )

    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments, then environment, then the YAML file (no dotenv)."""
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))

    @model_validator(mode="after")
    def _password_from_secret(self) -> ProcessSettings:
        if self.mqtt.password is not None or self.mqtt.username is None:
            return self
        secret = read_secret(self.mqtt.password_file, "mqtt_password")
        if secret is None:
            return self
        mqtt = self.mqtt.model_copy(update={"password": SecretStr(secret)})
        object.__setattr__(self, "mqtt", mqtt)
        return self


class Settings(ProcessSettings):
    """All settings of the node agent."""

    topics: TopicSettings = Field(default_factory=TopicSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)


def read_secret(secret_file: Path | None, credential: str) -> str | None:
    """A secret from ``secret_file`` or the systemd credential ``credential``, if any."""
    candidates: list[Path] = []
    if secret_file is not None:
        candidates.append(secret_file)
    cred_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    if cred_dir:
        candidates.append(Path(cred_dir) / credential)
    for path in candidates:
        if path.is_file():
            return path.read_text(encoding="utf-8").splitlines()[0] if path.stat().st_size else ""
    return None


# Keys that hold secrets: refused in a YAML file (they come from files or credentials).
_SECRET_KEYS = (("mqtt", "password"), ("influx", "token"))


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """The node agent's settings from YAML, the environment and ``overrides``."""
    return load_settings_as(Settings, config_file, **overrides)


def load_settings_as(
    cls: type[SettingsT], config_file: Path | None = None, **overrides: Any
) -> SettingsT:
    """Build settings of type ``cls`` (the agent's by default) from YAML, env and overrides.

    Raises ``ConfigError`` with every problem when the result is invalid, and refuses a
    secret (MQTT password, InfluxDB token) written into the YAML file.
    """
    import yaml  # noqa: PLC0415 - only needed here
    from pydantic import ValidationError  # noqa: PLC0415

    from polca.errors import ConfigError  # noqa: PLC0415

    path = config_file or (
        Path(os.environ["POLCA_CONFIG"]) if "POLCA_CONFIG" in os.environ else None
    )
    if path is not None:
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            msg = f"cannot read configuration {path}: {exc}"
            raise ConfigError(msg) from exc
        for group, key in _SECRET_KEYS:
            if isinstance(raw, dict) and isinstance(raw.get(group), dict) and key in raw[group]:
                msg = (
                    f"{path}: {group}.{key} is not allowed in the configuration file; use "
                    f"{group}.{key}_file, POLCA_{group.upper()}__{key.upper()} or a systemd "
                    "credential"
                )
                raise ConfigError(msg)

    file_settings = type(
        "FileSettings", (cls,), {"model_config": SettingsConfigDict(yaml_file=path)}
    )
    try:
        result: SettingsT = file_settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        where = f" in {path}" if path else ""
        msg = f"invalid settings{where}: {problems}"
        raise ConfigError(msg) from exc
    return result
