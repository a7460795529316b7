"""Settings: YAML file, POLCA_* environment, secrets from files and credentials only."""

from __future__ import annotations

from pathlib import Path

import pytest

from polca.errors import ConfigError
from polca.settings import load_settings


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
