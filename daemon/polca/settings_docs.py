"""Render the configuration reference (``docs/configuration.md``) from the settings models.

Generated, never hand-edited: a test fails when the committed file differs from
``polca config docs``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from polca.agent.config import Settings, load_settings
from polca.assign.config import KubernetesAssignment, PriorityThreshold

_HEADER = """# Configuration reference

polca reads its settings from, strongest first:

1. command-line options (`--backend`, `--policy`, `--broker`, ...);
2. environment variables `POLCA_<GROUP>__<KEY>` (for example `POLCA_MQTT__HOST=broker.dc1`);
3. the YAML file given by `--config FILE` or `POLCA_CONFIG`;
4. the defaults below.

Secrets never live in the YAML file: the MQTT password comes from `POLCA_MQTT__PASSWORD`,
from `mqtt.password_file`, or from a systemd credential named `mqtt_password`
(`LoadCredential=mqtt_password:/etc/polca/mqtt.pass`, read from `$CREDENTIALS_DIRECTORY`).
A `mqtt.password` key in the YAML file is refused with an error.

Example `/etc/polca/agent.yaml`:

```yaml
mqtt:
  host: mqtt.dc1.example
  port: 8883
  tls: true
  tls_ca_file: /etc/polca/ca.pem
  username: node-a17
  password_file: /etc/polca/mqtt.pass
topics:
  site: dc1
  row: row4
  rack: r12
gpu:
  backend: nvml
agent:
  policy_file: /etc/polca/policy.yaml
```

`polca config show --config FILE` prints the effective settings with secrets hidden.
"""


def _default(field: Any) -> str:
    if field.default_factory is not None:
        name = getattr(field.default_factory, "__name__", "")
        if name == "<lambda>":
            return "(computed, see description)"
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        return f"`{value}`" if not isinstance(value, BaseModel) else "(group)"
    if field.default is PydanticUndefined:
        return "(required)"
    if field.default is None:
        return "none"
    value = field.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _group_table(group_name: str, model: type[BaseModel], *, env: bool = True) -> list[str]:
    doc = (model.__doc__ or "").strip().splitlines()[0]
    lines = [f"\n### `{group_name}`: {doc}\n"]
    lines.append(
        "| key | environment variable | default | meaning |"
        if env
        else "| key | default | meaning |"
    )
    lines.append("|---|---|---|---|" if env else "|---|---|---|")
    for name, field in model.model_fields.items():
        key = field.alias or name  # the YAML key
        desc = (field.description or "").replace("|", "\\|")
        if env:
            var = f"POLCA_{group_name.upper()}__{key.upper()}"
            lines.append(f"| `{group_name}.{key}` | `{var}` | {_default(field)} | {desc} |")
        else:
            lines.append(f"| `{key}` | {_default(field)} | {desc} |")
    return lines


def _settings_tables(settings: type[BaseModel]) -> list[str]:
    lines: list[str] = []
    scalars = []
    for name, field in settings.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            lines.extend(_group_table(name, model))
        else:
            scalars.append((name, field))
    if scalars:
        top = [
            "\n### top-level keys\n",
            "| key | environment variable | default | meaning |",
            "|---|---|---|---|",
        ]
        for name, field in scalars:
            desc = (field.description or "").replace("|", "\\|")
            top.append(f"| `{name}` | `POLCA_{name.upper()}` | {_default(field)} | {desc} |")
        lines = top + lines
    return lines


def render() -> str:
    """The Markdown reference of every setting, with its environment variable and default."""
    from polca.aggregator.config import (  # noqa: PLC0415 - the docs cover both daemons
        AggregatorSettings,
        NodeSpec,
        RackSpec,
        RowFeedSpec,
        RowSpec,
    )
    from polca.bmc.config import BmcNode  # noqa: PLC0415
    from polca.redfish.api import RedfishEndpoint  # noqa: PLC0415

    lines = [_HEADER, "\n## Node agent (`polca agent`)"]
    lines.extend(_settings_tables(Settings))
    lines.extend(_group_table("assignment.kubernetes", KubernetesAssignment, env=False))
    lines.extend(
        _group_table("assignment.kubernetes.priority_thresholds[]", PriorityThreshold, env=False)
    )
    lines.append("\n## Aggregator (`polca aggregator`)")
    lines.append(
        "\nThe same sources and secret rules apply; the InfluxDB token comes from "
        "`POLCA_INFLUX__TOKEN`, `influx.token_file` or the `influx_token` credential, never "
        "from the YAML file. `rows` is the topology (see `deploy/aggregator.example.yaml`)."
    )
    lines.extend(_settings_tables(AggregatorSettings))
    for name, model in (
        ("rows[]", RowSpec),
        ("rows[].feeds[]", RowFeedSpec),
        ("rows[].racks[]", RackSpec),
        ("rows[].racks[].nodes[]", NodeSpec),
        ("bmc.nodes.<node>", BmcNode),
        ("bmc.nodes.<node>.endpoint", RedfishEndpoint),
    ):
        lines.extend(_group_table(name, model, env=False))
    lines.extend(_facility_tables())
    return "\n".join(lines) + "\n"


def _facility_tables() -> list[str]:
    """``polca meter`` and ``polca cdu``: the site's PDUs, meters and CDUs."""
    from polca.cdu.config import CduSettings  # noqa: PLC0415
    from polca.cdu.redfish import RedfishCduConfig  # noqa: PLC0415
    from polca.cdu.registers import ModbusCduConfig  # noqa: PLC0415
    from polca.meter.config import MeterRowConfig, MeterSettings  # noqa: PLC0415
    from polca.meter.modbus import MeterPoint, ModbusMeterConfig  # noqa: PLC0415
    from polca.meter.redfish import RedfishMeterConfig  # noqa: PLC0415
    from polca.meter.snmp import GenericOid, SnmpSourceConfig  # noqa: PLC0415
    from polca.redfish.api import RedfishEndpoint  # noqa: PLC0415

    lines = ["\n## Row power (`polca meter run`)"]
    lines.append(
        "\nEach row's power is the sum of its sources, read every `interval_s` and published "
        "on the row's meter topic (see [facility.md](facility.md) and "
        "`deploy/meter.example.yaml`). An SNMP community, SNMPv3 keys and Redfish passwords "
        "come from files or systemd credentials, never from the YAML file."
    )
    lines.extend(_settings_tables(MeterSettings))
    groups: tuple[tuple[str, type[BaseModel]], ...] = (
        ("rows[]", MeterRowConfig),
        ("rows[].sources[] (protocol: snmp)", SnmpSourceConfig),
        ("rows[].sources[].generic[]", GenericOid),
        ("rows[].sources[] (protocol: redfish)", RedfishMeterConfig),
        ("rows[].sources[].endpoint", RedfishEndpoint),
        ("rows[].sources[] (protocol: modbus)", ModbusMeterConfig),
        ("rows[].sources[].points[]", MeterPoint),
    )
    for name, model in groups:
        lines.extend(_group_table(name, model, env=False))
    lines.append("\n## CDU sources (`polca cdu modbus`, `polca cdu redfish`)")
    lines.extend(_settings_tables(CduSettings))
    groups = (
        ("modbus", ModbusCduConfig),
        ("redfish", RedfishCduConfig),
        ("redfish.endpoint", RedfishEndpoint),
    )
    for name, model in groups:
        lines.extend(_group_table(name, model, env=False))
    lines.extend(_site_tables())
    return lines


def _site_tables() -> list[str]:
    """``polca site run``: the site controller."""
    from polca.sitectl.config import SiteSettings  # noqa: PLC0415

    lines = ["\n## The site controller (`polca site run`)"]
    lines.append(
        "\nShares each power domain's live capacity among the rows it feeds and publishes "
        "each row's leased budget; the tree is the site file `tree_file` names (see "
        "[power-tree.md](power-tree.md) and `deploy/site/`)."
    )
    lines.extend(_settings_tables(SiteSettings))
    return lines


def show(config: Path | None, *, out: TextIO) -> int:
    """Print the effective settings as JSON, secrets masked."""
    settings = load_settings(config)
    out.write(json.dumps(settings.model_dump(mode="json"), indent=2, default=str) + "\n")
    return 0
