"""What the settings of every polca process share, with a documented default each.

Each process's own settings live with it (``agent/config.py``, ``aggregator/config.py``,
``meter/config.py``, ``cdu/config.py``, ``assign/publish.py``; the agent's groups
``gpu/config.py`` and ``assign/config.py``); here are their common base
(``ProcessSettings``: ``mqtt``, ``logging``, ``metrics``), the groups more than one
process uses (``InfluxSettings``), the names every topic is built from (``TOPIC_SEGMENT``,
``SiteName``, ``TopicRoot``, declared once), and the one loader, ``load_settings_as``.

Sources, strongest first: keyword arguments (the CLI), ``POLCA_*`` environment variables
(nested with ``__``, e.g. ``POLCA_MQTT__HOST``), the YAML file named by ``--config`` or
``POLCA_CONFIG``, then secret files. Secrets (the MQTT password, the InfluxDB token: every
``SecretStr`` field) never come from the YAML, whatever the case of their keys: they come
from ``POLCA_MQTT__PASSWORD``, ``mqtt.password_file``, or a systemd credential named
``mqtt_password`` in ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=``).

The configuration file is hostile until validated: it is read once, bounded, by
``polca.yamlkit`` (size, nesting, aliases, duplicate keys), and its data goes to the
settings as their weakest source. Numbers and booleans in it must be YAML numbers and
booleans (``port: "1883"`` or ``tls: "yes"`` is refused; the environment, which only has
strings, is converted as usual), and floats from any source must be finite.

``docs/configuration.md`` is generated from these models (``polca config docs``) and a test
keeps it in sync.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

TOPIC_SEGMENT: Final = r"^[A-Za-z0-9_.-]{1,128}$"
"""One segment of an MQTT topic polca builds (a site, row, rack or node name): no ``/``,
no wildcard, no space."""
SettingsT = TypeVar("SettingsT", bound="ProcessSettings")


MAX_SECRET_BYTES = 64 * 1024  # a password or token file larger than this is refused


class Group(BaseModel):
    """A group of settings (one YAML mapping): unknown keys refused, frozen, finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


MAX_MQTT_ENDPOINTS: Final = 16
"""The most broker endpoints one process takes (a cluster has a few nodes)."""

_HOST_NAME = r"^[A-Za-z0-9_.:-]{1,253}$"


@dataclasses.dataclass(frozen=True, slots=True)
class MqttEndpoint:
    """One broker node a process may connect to."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str, *, default_port: int) -> MqttEndpoint:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as an endpoint; ValueError names
    what is wrong."""
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            msg = f"bad MQTT endpoint {text!r}: expected [address]:port"
            raise ValueError(msg)
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    if not re.fullmatch(_HOST_NAME, host):
        msg = f"bad MQTT endpoint {text!r}: expected host:port"
        raise ValueError(msg)
    if not port_text:
        return MqttEndpoint(host, default_port)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        msg = f"bad MQTT endpoint {text!r}: the port must be 1-65535"
        raise ValueError(msg)
    return MqttEndpoint(host, int(port_text))


class MqttSettings(Group):
    """The MQTT broker connection."""

    host: str = Field(
        "127.0.0.1", description="Broker host name or address (when `endpoints` is empty)."
    )
    port: int = Field(
        1883,
        ge=1,
        le=65535,
        description="Broker TCP port (8883 for TLS); also the port of endpoints without one.",
    )
    endpoints: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        max_length=MAX_MQTT_ENDPOINTS,
        description="The nodes of a clustered broker, `host:port` each (a list, or one "
        "comma-separated string in POLCA_MQTT__ENDPOINTS). The process connects to one and, "
        "when it is lost, moves to the next one that has not failed lately, with backoff "
        "and jitter, and subscribes again. Empty: the one broker of `host` and `port`.",
    )
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
        "3.1.1",
        description="MQTT protocol version; 3.1.1 works with every broker (NATS speaks no "
        "other). With 5 (Mosquitto) the aggregator also refuses a meter or CDU reading sent "
        "retained as it arrives, not only when a new subscription delivers it.",
    )
    subscription_qos_max: Literal[0, 1, 2] | None = Field(
        None,
        description="The highest QoS the process subscribes with (control, policy and "
        "assignments ask for 1). Default: 1 with one broker, 0 with several `endpoints` (a "
        "cluster): on a NATS cluster each QoS 1 subscription is a replicated JetStream "
        "consumer per client and topic, made again on every connection and stalled while "
        "the cluster elects leaders after a node is lost (docs/mqtt.md). polca reads its "
        "state from retained messages again after every reconnect, so QoS 0 loses no "
        "state; a node event sent during a reconnect can be lost.",
    )
    tls: bool = Field(False, description="Connect with TLS.")
    tls_ca_file: Path | None = Field(None, description="CA bundle to verify the broker with.")
    tls_cert_file: Path | None = Field(None, description="Client certificate for mutual TLS.")
    tls_key_file: Path | None = Field(None, description="Client key for mutual TLS.")
    tls_insecure: bool = Field(False, description="Skip the broker host name check (testing only).")
    keepalive_s: int = Field(15, ge=5, le=3600, description="MQTT keepalive interval.")
    connect_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Timeout of each MQTT operation once connected (a publish, a "
        "subscribe); the connection is then given up and made again.",
    )
    connack_timeout_s: float = Field(
        10.0,
        gt=0,
        le=60,
        description="How long a connection attempt waits for the broker's CONNACK before "
        "it tries the next endpoint. A cluster node electing a JetStream leader leaves a "
        "CONNECT unanswered until the client gives up, while a new attempt after the "
        "election succeeds at once: 5 s halved the median reconnect after a node's crash "
        "but lengthened the slowest (docs/performance.md, broker failover).",
    )
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

    @field_validator("endpoints", mode="before")
    @classmethod
    def _endpoint_list(cls, value: object) -> object:
        if isinstance(value, str):  # the environment: "a:1883,b:1883"
            return tuple(part for part in (p.strip() for p in value.split(",")) if part)
        return value

    @model_validator(mode="after")
    def _endpoints_valid(self) -> Self:
        seen = self.broker_endpoints()  # raises on a bad one
        if len(set(seen)) != len(seen):
            msg = "mqtt.endpoints names the same endpoint twice"
            raise ValueError(msg)
        return self

    def where(self) -> str:
        """The endpoints for messages: ``host:port``, comma-separated."""
        return ", ".join(str(e) for e in self.broker_endpoints())

    def one_shot(self, timeout_s: float) -> MqttSettings:
        """These settings for a one-shot command (``polca status``, ``polca assign``):
        every operation, and each connection attempt, bounded by its ``timeout_s``."""
        return self.model_copy(
            update={
                "connect_timeout_s": timeout_s,
                "connack_timeout_s": min(timeout_s, self.connack_timeout_s),
            }
        )

    @property
    def clustered(self) -> bool:
        """Whether several broker endpoints are named (a clustered broker)."""
        return len(self.broker_endpoints()) > 1

    def subscription_qos_cap(self) -> int:
        """``subscription_qos_max``, or its default: 1 on one broker, 0 on a cluster."""
        if self.subscription_qos_max is not None:
            return self.subscription_qos_max
        return 0 if self.clustered else 1

    def broker_endpoints(self) -> tuple[MqttEndpoint, ...]:
        """The endpoints in order of preference: ``endpoints``, else ``host:port``."""
        if not self.endpoints:
            return (MqttEndpoint(self.host, self.port),)
        return tuple(parse_endpoint(e, default_port=self.port) for e in self.endpoints)


DEFAULT_TOPIC_ROOT: Final = "polca/v1"
"""The MQTT topic root every component uses unless configured (``polca.telemetry.topics``)."""

TOPIC_ROOT: Final = r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$"
"""A topic root: topic segments joined by ``/`` (no wildcard, no empty level)."""

TopicRoot = Annotated[
    str,
    Field(
        pattern=TOPIC_ROOT,
        max_length=128,
        description="MQTT topic root, including the schema version; every polca process "
        "of a site uses the same one.",
    ),
]
"""Where a process's topics start (``topic_root``, the agent's ``topics.root``)."""

DarkPollsDown = Annotated[
    int,
    Field(
        ge=1,
        le=1000,
        description="Meter readings with every source of a loss_means_down feed "
        "unreachable, after which the feed is down.",
    ),
]
"""The one rule of a feed gone dark (the aggregator's ``site_budget``, ``polca site``)."""

SiteName = Annotated[
    str,
    Field(
        pattern=TOPIC_SEGMENT,
        description="Site name: the topic segment after the root.",
    ),
]
"""The site a process belongs to (``site``, the agent's ``topics.site``)."""


class MetricsSettings(BaseModel):
    """Prometheus ``/metrics`` (docs/prometheus.md); off unless an address is set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = Field(
        None,
        pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*):[0-9]{1,5}$",
        description="HOST:PORT to serve /metrics on (e.g. 127.0.0.1:9464); unset: off.",
    )
    stale_after_s: float = Field(
        120.0, gt=0, le=86_400, description="A series not updated this long is not served."
    )
    max_series: int = Field(
        250_000, ge=1, le=10_000_000, description="Series kept at most (a topology's worth)."
    )


Thinnable = Literal["gpu", "gpu_health", "node", "rack", "row", "cooling_loop", "aggregator"]
"""The measurements whose write interval an operator can choose (``polca.export.schedule``)."""


class InfluxSettings(Group):
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
    workload_series: bool = Field(
        False,
        description="Also write gpu_workload (each GPU's class origin and the namespace, pod "
        "and container holding it): one series per GPU and pod, so off unless wanted.",
    )
    write_every_s: dict[Thinnable, Annotated[float, Field(gt=0, le=3600)]] = Field(
        default_factory=lambda: {"gpu": 1.0},  # type: ignore[arg-type]
        description="Per-measurement write intervals (s): a series is written at most this "
        "often, e.g. {gpu: 10, node: 1}; measurements not named are written every time, "
        "except gpu_health, at most once a second per node unless named (events, control "
        "decisions and alarms always are). See docs/influxdb.md.",
    )


class LoggingSettings(Group):
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
        allow_inf_nan=False,
    )
    # The configuration file's data, set on the subclass ``load_settings_as`` builds per call.
    _file_data: ClassVar[Mapping[str, Any]] = {}

    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    metrics: MetricsSettings = Field(
        default_factory=MetricsSettings,
        description="Prometheus /metrics of this process (off by default).",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments, then environment, then the configuration file (no dotenv).

        The file was read (once) by ``load_settings_as``; its keys match fields as keyword
        arguments do (case-insensitively at the top level).
        """
        file_data = dict(getattr(settings_cls, "_file_data", {}))
        return (init_settings, env_settings, InitSettingsSource(settings_cls, file_data))

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


def read_secret(secret_file: Path | None, credential: str) -> str | None:
    """A secret from ``secret_file`` or the systemd credential ``credential``, if any.

    The first line of the file, read bounded (``MAX_SECRET_BYTES``). Raises ``ValueError``
    (a settings problem, once inside the model) when the file is unreadable, too large or
    not UTF-8.
    """
    candidates: list[Path] = []
    if secret_file is not None:
        candidates.append(secret_file)
    cred_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    if cred_dir:
        candidates.append(Path(cred_dir) / credential)
    for path in candidates:
        if not path.is_file():
            continue
        try:
            with path.open("rb") as f:
                data = f.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            msg = f"cannot read the secret file {path}: {exc.strerror or exc}"
            raise ValueError(msg) from exc
        if len(data) > MAX_SECRET_BYTES:
            msg = f"secret file {path} is larger than {MAX_SECRET_BYTES} bytes"
            raise ValueError(msg)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"secret file {path} is not UTF-8 text"
            raise ValueError(msg) from exc
        return text.splitlines()[0] if text else ""
    return None


def broker_override(broker: str | None) -> dict[str, Any]:
    """The ``mqtt`` settings a ``--broker host[:port]`` option overrides (none when unset).

    Raises:
        ConfigError: the port is not a number.
    """
    if not broker:
        return {}
    host, sep, port = broker.rpartition(":")
    if not sep:
        return {"host": broker}
    if not port.isdigit():
        from polca.errors import ConfigError  # noqa: PLC0415

        msg = f"--broker {broker!r}: the port must be a number (host[:port])"
        raise ConfigError(msg)
    return {"host": host, "port": int(port)}


class OneShotSettings(ProcessSettings):
    """A one-shot command's settings (``polca assign``, ``polca budget``): the broker (its
    ``mqtt`` group), the site and the topic root."""

    topic_root: TopicRoot = DEFAULT_TOPIC_ROOT
    site: SiteName = "site"


def load_one_shot_settings(cls: type[SettingsT], args: Any) -> SettingsT:
    """A one-shot command's settings: ``--config`` with its ``--broker``, ``--username``,
    ``--password-file`` and ``--site`` options over them."""
    mqtt: dict[str, Any] = broker_override(args.broker)
    if args.username is not None:
        mqtt["username"] = args.username
    if args.password_file is not None:
        mqtt["password_file"] = args.password_file
    over: dict[str, Any] = {"mqtt": mqtt} if mqtt else {}
    if args.site is not None:
        over["site"] = args.site
    return load_settings_as(cls, args.config, **over)


def source_overrides(
    *,
    broker: str | None,
    site: str | None,
    interval_s: float | None,
    log_level: str | None,
    log_format: str | None,
) -> dict[str, Any]:
    """The settings a telemetry source's command line overrides (``polca cdu``, ``polca
    meter``): ``--broker host[:port]``, ``--site``, ``--interval``, ``--log-*``."""
    over: dict[str, Any] = {}
    if broker:
        over["mqtt"] = broker_override(broker)
    if site:
        over["site"] = site
    if interval_s:
        over["interval_s"] = interval_s
    log_over = {k: v for k, v in (("level", log_level), ("format", log_format)) if v}
    if log_over:
        over["logging"] = log_over
    return over


def load_source_settings(cls: type[SettingsT], args: Any) -> SettingsT:
    """A telemetry source's settings (``polca cdu``, ``polca meter``): ``--config`` with
    the options ``source_overrides`` takes from its command line ``args``."""
    over = source_overrides(
        broker=args.broker,
        site=args.site,
        interval_s=args.interval,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    return load_settings_as(cls, args.config, **over)


def load_settings_as(
    cls: type[SettingsT], config_file: Path | None = None, **overrides: Any
) -> SettingsT:
    """Build settings of type ``cls`` (the agent's by default) from YAML, env and overrides.

    Raises ``ConfigError`` with every problem when the result is invalid; refuses a secret
    (any ``SecretStr`` field: the MQTT password, the InfluxDB token) written into the YAML
    file under any spelling of its keys, two top-level keys that differ only in case, and
    a number or boolean written as a string.
    """
    from pydantic import ValidationError  # noqa: PLC0415 - only needed here
    from pydantic_settings import SettingsError  # noqa: PLC0415

    from polca.errors import ConfigError  # noqa: PLC0415

    path = config_file or (
        Path(os.environ["POLCA_CONFIG"]) if "POLCA_CONFIG" in os.environ else None
    )
    file_data = _read_config(cls, path) if path is not None else {}
    file_settings = type(cls.__name__, (cls,), {"_file_data": file_data})
    try:
        result: SettingsT = file_settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        where = f" in {path}" if path else ""
        msg = f"invalid settings{where}: {problems}"
        raise ConfigError(msg) from exc
    except SettingsError as exc:  # an environment variable that does not parse
        msg = f"invalid settings: {exc}"
        raise ConfigError(msg) from exc
    return result


def _read_config(cls: type[BaseModel], path: Path) -> dict[str, Any]:
    """The configuration file's data: read once, bounded, checked before validation."""
    from polca import yamlkit  # noqa: PLC0415 - only needed with a file
    from polca.errors import ConfigError  # noqa: PLC0415

    raw = yamlkit.load_file(path, what="configuration", error=ConfigError)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        msg = f"{path}: the configuration must be a mapping (key: value), not a {_kind(raw)}"
        raise ConfigError(msg)
    seen: dict[str, str] = {}
    for key in raw:
        if not isinstance(key, str):
            msg = f"{path}: configuration key {key!r} is not a name"
            raise ConfigError(msg)
        other = seen.setdefault(key.lower(), key)
        if other != key:  # settings match top-level keys case-insensitively: ambiguous
            msg = f"{path}: keys {other!r} and {key!r} name the same setting; keep one"
            raise ConfigError(msg)
    for secret in _secret_fields(cls):
        written = _find_casefold(raw, secret)
        if written is not None:
            raise ConfigError(_secret_message(path, cls, secret, written))
    problems = list(_loose_scalars(cls, raw, ()))
    if problems:
        msg = f"invalid settings in {path}: {'; '.join(problems)}"
        raise ConfigError(msg)
    return raw


def _kind(value: object) -> str:
    return "list" if isinstance(value, list) else type(value).__name__


def _field_types(annotation: Any) -> tuple[Any, ...]:
    """The types a field annotation admits: ``X | None`` and ``Annotated[X, ...]`` unwrapped."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _field_types(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(annotation) for t in _field_types(arg))
    return (annotation,)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    models = [
        t for t in _field_types(annotation) if isinstance(t, type) and issubclass(t, BaseModel)
    ]
    return models[0] if len(models) == 1 else None


def _secret_fields(cls: type[BaseModel]) -> Iterator[tuple[str, ...]]:
    """Dotted paths of every ``SecretStr`` field of ``cls``, through nested groups."""
    for name, info in cls.model_fields.items():
        kinds = _field_types(info.annotation)
        if SecretStr in kinds:
            yield (name,)
        model = _model_of(info.annotation)
        if model is not None:
            yield from ((name, *rest) for rest in _secret_fields(model))


def _find_casefold(data: Mapping[Any, Any], path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The keys, as written, that spell ``path`` in ``data`` in any case; None if none do."""
    head, *rest = path
    for key, value in data.items():
        if not (isinstance(key, str) and key.lower() == head):
            continue
        if not rest:
            return (key,)
        if isinstance(value, Mapping):
            found = _find_casefold(value, tuple(rest))
            if found is not None:
                return (key, *found)
    return None


def _secret_message(
    path: Path, cls: type[BaseModel], secret: tuple[str, ...], written: tuple[str, ...]
) -> str:
    dotted = ".".join(secret)
    ways = []
    parent: type[BaseModel] | None = cls
    for part in secret[:-1]:
        parent = _model_of(parent.model_fields[part].annotation) if parent else None
    if parent is not None and f"{secret[-1]}_file" in parent.model_fields:
        ways.append(f"{dotted}_file")
    ways.append(f"POLCA_{'__'.join(part.upper() for part in secret)}")
    ways.append(f"the systemd credential {'_'.join(secret)}")
    return (
        f"{path}: {'.'.join(written)} is not allowed in the configuration file (it is the "
        f"secret {dotted}); use {', '.join(ways[:-1])} or {ways[-1]}"
    )


def _loose_scalars(
    cls: type[BaseModel], data: Mapping[Any, Any], loc: tuple[str, ...]
) -> Iterator[str]:
    """Numbers and booleans written as strings (or booleans as numbers) in the file's data.

    Pydantic would convert them; a configuration file is typed YAML, so they are refused.
    Only fields whose every type is a number, or a boolean, are checked; nested groups and
    tuples of groups are followed. Keys are matched as pydantic matches them (the top level
    case-insensitively, as the settings sources do).
    """
    fields = cls.model_fields
    by_lower = {name.lower(): name for name in fields} if not loc else {}
    for key, value in data.items():
        if not isinstance(key, str):
            continue
        name = key if key in fields else by_lower.get(key.lower())
        if name is None or value is None:
            continue
        annotation = fields[name].annotation
        where = ".".join((*loc, key))
        kinds = {t for t in _field_types(annotation) if t is not type(None)}
        if kinds == {bool}:
            if not isinstance(value, bool):
                yield f"{where}: expected true or false, got {_shown(value)}"
        elif kinds and kinds <= {int, float}:
            if isinstance(value, bool) or not isinstance(value, int | float):
                yield f"{where}: expected a number, got {_shown(value)}"
        elif isinstance(value, Mapping) and (model := _model_of(annotation)) is not None:
            yield from _loose_scalars(model, value, (*loc, key))
        elif isinstance(value, list) and (model := _item_model(annotation)) is not None:
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    yield from _loose_scalars(model, item, (*loc, key, str(i)))


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """``M`` of a ``tuple[M, ...]`` or ``list[M]`` field, if it is a model."""
    for kind in _field_types(annotation):
        if typing.get_origin(kind) in (tuple, list):
            args = [a for a in typing.get_args(kind) if a is not Ellipsis]
            if len(args) == 1:
                return _model_of(args[0])
    return None


def _shown(value: object) -> str:
    text = repr(value)
    kind = "a string" if isinstance(value, str) else _kind(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"
