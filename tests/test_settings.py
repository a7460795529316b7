"""Settings: YAML file, POLCA_* environment, secrets from files and credentials only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from pydantic import ValidationError

from polca import yamlkit
from polca.agent.config import Settings, load_settings
from polca.aggregator.config import AggregatorSettings
from polca.cdu.config import CduSettings
from polca.errors import ConfigError
from polca.settings import MAX_SECRET_BYTES, InfluxSettings, ProcessSettings, load_settings_as
from tests.fuzzing import FUZZ, mutated


def test_defaults_are_valid_and_documented_values() -> None:
    """With no file and no environment, the defaults load."""
    settings = load_settings()
    assert settings.mqtt.port == 1883
    assert settings.agent.sample_interval_s == pytest.approx(0.1)
    assert settings.agent.publish_interval_s == pytest.approx(1.0)
    assert settings.gpu.backend == "nvml"


def test_environment_beats_yaml_and_yaml_beats_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POLCA_GROUP__KEY overrides the YAML file, which overrides defaults."""
    config = tmp_path / "agent.yaml"
    config.write_text("mqtt:\n  host: broker.dc1\n  port: 8883\ntopics:\n  row: row4\n")
    monkeypatch.setenv("POLCA_MQTT__PORT", "1999")
    settings = load_settings(config)
    assert settings.mqtt.host == "broker.dc1"
    assert settings.mqtt.port == 1999
    assert settings.topics.row == "row4"


def test_password_in_yaml_is_refused(tmp_path: Path) -> None:
    """A secret written into the configuration file is an error naming the alternatives."""
    config = tmp_path / "agent.yaml"
    config.write_text("mqtt:\n  username: n1\n  password: hunter2\n")
    with pytest.raises(ConfigError, match="password_file"):
        load_settings(config)


def test_password_from_file_and_from_systemd_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The password comes from password_file, else $CREDENTIALS_DIRECTORY/mqtt_password."""
    secret = tmp_path / "mqtt.pass"
    secret.write_text("s3cret\n")
    config = tmp_path / "agent.yaml"
    config.write_text(f"mqtt:\n  username: n1\n  password_file: {secret}\n")
    settings = load_settings(config)
    assert settings.mqtt.password is not None
    assert settings.mqtt.password.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)

    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "mqtt_password").write_text("from-systemd")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    config.write_text("mqtt:\n  username: n1\n")
    settings = load_settings(config)
    assert settings.mqtt.password is not None
    assert settings.mqtt.password.get_secret_value() == "from-systemd"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("mqtt:\n  port: 70000\n", "mqtt.port"),
        ("mqtt:\n  hots: x\n", "hots"),
        ("topics:\n  rack: 'rack 7'\n", "topics.rack"),
        ("agent: [1, 2\n", "cannot read"),
    ],
)
def test_invalid_settings_name_the_key(tmp_path: Path, text: str, fragment: str) -> None:
    """Out-of-range values, unknown keys, bad topic segments and bad YAML say where."""
    config = tmp_path / "agent.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_settings(config)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    """Write a configuration file and return its path."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("cls", "text", "written", "alternatives"),
    [
        (Settings, "mqtt: {password: hunter2}\n", "mqtt.password", "POLCA_MQTT__PASSWORD"),
        (Settings, "MQTT: {password: hunter2}\n", "MQTT.password", "mqtt.password_file"),
        (Settings, "Mqtt: {Password: hunter2}\n", "Mqtt.Password", "mqtt_password"),
        (Settings, "mqtt: {PASSWORD: hunter2}\n", "mqtt.PASSWORD", "POLCA_MQTT__PASSWORD"),
        (Settings, "mqtt: {password: null}\n", "mqtt.password", "mqtt.password_file"),
        (Settings, "b: &b {password: hunter2}\nmqtt: {<<: *b}\n", "mqtt.password", "password_file"),
        (CduSettings, "MQTT: {PassWord: hunter2}\n", "MQTT.PassWord", "POLCA_MQTT__PASSWORD"),
        (AggregatorSettings, "mqtt: {password: hunter2}\n", "mqtt.password", "mqtt.password_file"),
        (AggregatorSettings, "influx: {token: hunter2}\n", "influx.token", "influx.token_file"),
        (AggregatorSettings, "INFLUX: {token: hunter2}\n", "INFLUX.token", "POLCA_INFLUX__TOKEN"),
        (AggregatorSettings, "influx: {TOKEN: hunter2}\n", "influx.TOKEN", "influx_token"),
        (AggregatorSettings, "Influx: {Token: hunter2}\n", "Influx.Token", "influx.token_file"),
    ],
)
def test_secrets_are_refused_whatever_the_case(
    tmp_path: Path, cls: type[ProcessSettings], text: str, written: str, alternatives: str
) -> None:
    """Every spelling of a secret's keys is refused, naming the key and where secrets go."""
    with pytest.raises(ConfigError) as info:
        load_settings_as(cls, write(tmp_path, text))
    message = str(info.value)
    assert f"{written} is not allowed in the configuration file" in message
    assert alternatives in message
    assert "hunter2" not in message


@pytest.mark.parametrize("group", ["mqtt", "MQTT", "Mqtt", "mQtT"])
def test_top_level_keys_match_in_any_case(tmp_path: Path, group: str) -> None:
    """The settings sources match top-level keys case-insensitively: hence the refusal above."""
    settings = load_settings(write(tmp_path, f"{group}: {{host: b1, username: u}}\n"))
    assert settings.mqtt.host == "b1"


def test_keys_differing_only_in_case_are_ambiguous(tmp_path: Path) -> None:
    """mqtt and MQTT in one file would silently drop one of them: refused."""
    with pytest.raises(ConfigError, match="'mqtt' and 'MQTT' name the same setting"):
        load_settings(write(tmp_path, "mqtt: {host: a}\nMQTT: {port: 2}\n"))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('mqtt: {port: "1883"}\n', "mqtt.port: expected a number, got a string '1883'"),
        ("mqtt: {port: true}\n", "mqtt.port: expected a number, got bool True"),
        ("mqtt: {tls: 'yes'}\n", "mqtt.tls: expected true or false, got a string 'yes'"),
        ("mqtt: {tls: 1}\n", "mqtt.tls: expected true or false, got int 1"),
        ("agent: {sample_interval_s: '0.1'}\n", "agent.sample_interval_s: expected a number"),
        ("mqtt: {connect_timeout_s: .inf}\n", "not finite"),
        ("gpu: {simulated_seed: " + "9" * 50 + "}\n", "integer of 50 characters"),
    ],
)
def test_numbers_and_booleans_are_typed(tmp_path: Path, text: str, fragment: str) -> None:
    """No string or bool is converted to a number (or a bool) from the file; floats finite."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_settings(write(tmp_path, text))


def test_environment_floats_must_be_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLCA_MQTT__CONNECT_TIMEOUT_S=inf is refused (gt=0 alone would take it)."""
    monkeypatch.setenv("POLCA_MQTT__CONNECT_TIMEOUT_S", "inf")
    with pytest.raises(ConfigError, match=r"mqtt\.connect_timeout_s"):
        load_settings()


def test_keywords_beat_environment_beat_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Precedence: keyword arguments, then POLCA_* variables, then the file."""
    config = write(tmp_path, "mqtt: {host: from-file, port: 1001, keepalive_s: 30}\n")
    monkeypatch.setenv("POLCA_MQTT__PORT", "1002")
    monkeypatch.setenv("POLCA_MQTT__HOST", "from-env")
    settings = load_settings(config, mqtt={"host": "from-kwargs"})
    assert (settings.mqtt.host, settings.mqtt.port, settings.mqtt.keepalive_s) == (
        "from-kwargs",
        1002,
        30,
    )


def test_file_is_read_once_through_the_bounded_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bounded parse per load; PyYAML's unbounded safe_load is never called."""
    calls: list[str] = []
    real_parse = yamlkit.parse

    def counting(text: str, **kwargs: Any) -> yamlkit.Document:
        calls.append(kwargs["source"])
        return real_parse(text, **kwargs)

    def forbidden(*_args: object, **_kwargs: object) -> object:
        pytest.fail("yaml.safe_load called")

    monkeypatch.setattr(yamlkit, "parse", counting)
    monkeypatch.setattr(yaml, "safe_load", forbidden)
    config = write(tmp_path, "mqtt: {host: once}\n")
    assert load_settings(config).mqtt.host == "once"
    assert calls == [str(config)]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("mqtt: " + "[" * 100_000 + "\n", ":1:70: YAML nested deeper than 64 levels"),
        (
            "a: &a [x,x,x,x,x,x,x,x,x]\n"
            + "".join(
                f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n"
                for p, n in zip("abcdef", "bcdefg", strict=True)
            ),
            "YAML expands",
        ),
        ("mqtt: {host: a, host: b}\n", ":1:17: duplicate key 'host'"),
        ("- mqtt\n", "must be a mapping (key: value), not a list"),
        ("1: x\n", "configuration key 1 is not a name"),
        ("mqtt: {host: 2023-02-30}\n", "day is out of range"),
    ],
)
def test_hostile_files_are_config_errors(tmp_path: Path, text: str, fragment: str) -> None:
    """Deep nesting, alias bombs, duplicates and odd shapes are ConfigErrors with places."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_settings(write(tmp_path, text))


def test_oversized_file_and_secret_are_refused(tmp_path: Path) -> None:
    """A configuration file or a secret file over its bound is not read whole."""
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (2 * 1024 * 1024))
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_settings(big)
    secret = tmp_path / "pass"
    secret.write_bytes(b"x" * (MAX_SECRET_BYTES + 1))
    config = write(tmp_path, f"mqtt: {{username: u, password_file: {secret}}}\n")
    with pytest.raises(ConfigError, match="larger than 65536 bytes"):
        load_settings(config)
    secret.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(config)


VALID_CONFIG = """\
mqtt:
  host: broker.dc1
  port: 8883
  tls: true
  username: node7
  keepalive_s: 30
topics: {site: dc1, row: row4, rack: r12, node: n7}
gpu: {backend: simulated, simulated_count: 4, simulated_seed: 3}
agent:
  sample_interval_s: 0.2
  observe_only: false
logging: {level: debug, format: json}
"""


@FUZZ
@given(text=mutated(VALID_CONFIG))
def test_fuzz_mutated_configuration_only_raises_config_error(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    """Any mutation of a valid file gives settings or a ConfigError, never another error."""
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        assert str(exc)  # noqa: PT017 - the point is what escapes, not a single raise
        return
    assert isinstance(settings, Settings)


def test_valid_configuration_decodes_to_its_values(tmp_path: Path) -> None:
    """The unmutated fuzz seed loads to the values it spells."""
    settings = load_settings(write(tmp_path, VALID_CONFIG))
    assert (settings.mqtt.host, settings.mqtt.port, settings.mqtt.tls) == ("broker.dc1", 8883, True)
    assert settings.topics.node == "n7"
    assert settings.gpu.simulated_count == 4
    assert settings.agent.sample_interval_s == pytest.approx(0.2)
    assert settings.logging.format == "json"


@pytest.mark.parametrize(
    "every_s",
    [{"event": 1.0}, {"control": 1.0}, {"gpu": 0}, {"gpu": 7200}, {"gpu": "10"}, {"gpu": True}],
)
def test_write_intervals_name_thinnable_measurements_only(every_s: dict[str, Any]) -> None:
    """Events, control and alarms are always written; an interval is 0 < s <= 3600, a number."""
    with pytest.raises(ValidationError, match="write_every_s"):
        InfluxSettings.model_validate({"write_every_s": every_s}, strict=True)
    assert InfluxSettings().write_every_s == {"gpu": 1.0}
    assert InfluxSettings.model_validate(
        {"write_every_s": {"gpu": 10, "row": 1}}
    ).write_every_s == {
        "gpu": 10.0,
        "row": 1.0,
    }


def test_a_broker_option_is_host_and_port_or_a_clear_error() -> None:
    """``--broker host[:port]``: the host alone, both, nothing when unset; a port that is
    not a number is a configuration error naming the option (the command exits 78)."""
    from polca.errors import ConfigError
    from polca.settings import broker_override

    assert broker_override(None) == {}
    assert broker_override("mq.example") == {"host": "mq.example"}
    assert broker_override("mq.example:8883") == {"host": "mq.example", "port": 8883}
    with pytest.raises(ConfigError, match=r"--broker 'mq\.example:mqtts'"):
        broker_override("mq.example:mqtts")


def test_site_topic_root_and_the_segment_rule_are_declared_once() -> None:
    """Every process's ``site`` and ``topic_root`` (the agent's ``topics.site`` and
    ``topics.root``) is ``settings.SiteName``/``TopicRoot``: one rule, one description;
    and no module of polca writes the topic-segment pattern but ``settings.py``."""
    from pydantic import BaseModel

    from polca.agent.config import TopicSettings
    from polca.aggregator.config import AggregatorSettings
    from polca.assign.publish import AssignSettings
    from polca.cdu.config import CduSettings
    from polca.meter.config import MeterSettings
    from polca.settings import TOPIC_SEGMENT, SiteName, TopicRoot

    class Reference(BaseModel):
        site: SiteName = "site"
        root: TopicRoot = "polca/v1"

    want = {name: (f.description, repr(f.metadata)) for name, f in Reference.model_fields.items()}
    owners: list[tuple[type[BaseModel], str, str]] = [(TopicSettings, "site", "root")]
    owners += [
        (cls, "site", "topic_root")
        for cls in (AggregatorSettings, AssignSettings, CduSettings, MeterSettings)
    ]
    for cls, site, root in owners:
        for field, ref in ((site, "site"), (root, "root")):
            info = cls.model_fields[field]
            assert (info.description, repr(info.metadata)) == want[ref], (cls.__name__, field)
    package = Path(__file__).resolve().parents[1] / "daemon" / "polca"
    literal = TOPIC_SEGMENT.strip("^$").split("{")[0]  # [A-Za-z0-9_.-]
    writers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if f'r"^{literal}+$"' in path.read_text(encoding="utf-8")
        or f'r"^{literal}{{1,128}}$"' in path.read_text(encoding="utf-8")
        or f'r"{literal}+"' in path.read_text(encoding="utf-8")
    )
    assert writers == ["settings.py", "sim/profile.py"]  # the latter: a profile's name
