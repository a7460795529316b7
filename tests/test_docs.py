"""Generated references stay in sync with the code that defines them."""

from __future__ import annotations

from pathlib import Path

from polca import settings_docs
from polca.policy.schema_export import main as policy_schema_check
from polca.telemetry.schema_docs import main as mqtt_schema_check
from polca.telemetry.schema_docs import with_schemas

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md equals `polca config docs` (regenerate with that command)."""
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == settings_docs.render()


def test_every_setting_is_documented_with_env_var() -> None:
    """Each settings key appears with its POLCA_ environment variable."""
    text = settings_docs.render()
    for key in (
        "POLCA_MQTT__HOST",
        "POLCA_AGENT__OBSERVE_ONLY",
        "POLCA_GPU__BACKEND",
        "POLCA_TOPICS__NODE",
        "POLCA_LOGGING__FORMAT",
    ):
        assert key in text


def test_mqtt_payload_schemas_are_current() -> None:
    """docs/mqtt.md embeds the current JSON Schema of every payload."""
    assert mqtt_schema_check(["--check", str(ROOT / "docs" / "mqtt.md")]) == 0


def test_stale_mqtt_block_is_detected(tmp_path: Path) -> None:
    """The check fails on a document whose schema block is out of date."""
    stale = tmp_path / "mqtt.md"
    stale.write_text("x\n<!-- BEGIN SCHEMAS -->\nold\n<!-- END SCHEMAS -->\n", encoding="utf-8")
    assert mqtt_schema_check(["--check", str(stale)]) == 1
    assert "Telemetry" in with_schemas(stale.read_text(encoding="utf-8"))


def test_policy_schema_is_current() -> None:
    """docs/policy.md embeds the current policy JSON Schema."""
    assert policy_schema_check(["--check", str(ROOT / "docs" / "policy.md")]) == 0


def test_every_credential_the_docs_name_is_the_one_the_units_load() -> None:
    """A ``LoadCredential=ID:PATH`` quoted in the docs is the very line of a shipped unit
    (an operator copies the path from the docs and the unit fails on another)."""
    import re

    shipped = {
        line.strip()
        for unit in (ROOT / "systemd").iterdir()
        if unit.suffix in {".service", ".conf"}
        for line in unit.read_text(encoding="utf-8").splitlines()
        if line.startswith("LoadCredential=")
    }
    assert shipped
    documents = [
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
        ROOT / "deploy" / "README.md",
        ROOT / "systemd" / "README.md",
    ]
    quoted = {
        (doc.name, match)
        for doc in documents
        for match in re.findall(r"LoadCredential=[\w.-]+:/[^\s`]+", doc.read_text(encoding="utf-8"))
    }
    assert quoted
    assert {(name, line) for name, line in quoted if line not in shipped} == set()
