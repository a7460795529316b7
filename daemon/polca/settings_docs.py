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

from polca.settings import Settings, load_settings

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


def render() -> str:
    """The Markdown reference of every setting, with its environment variable and default."""
    lines = [_HEADER]
    for group_name, group_field in Settings.model_fields.items():
        model = group_field.annotation
        assert isinstance(model, type)  # noqa: S101 - every field is a settings group
        assert issubclass(model, BaseModel)  # noqa: S101
        doc = (model.__doc__ or "").strip().splitlines()[0]
        lines.append(f"\n## `{group_name}`: {doc}\n")
        lines.append("| key | environment variable | default | meaning |")
        lines.append("|---|---|---|---|")
        for key, field in model.model_fields.items():
            env = f"POLCA_{group_name.upper()}__{key.upper()}"
            desc = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{group_name}.{key}` | `{env}` | {_default(field)} | {desc} |")
    return "\n".join(lines) + "\n"


def show(config: Path | None, *, out: TextIO) -> int:
    """Print the effective settings as JSON, secrets masked."""
    settings = load_settings(config)
    out.write(json.dumps(settings.model_dump(mode="json"), indent=2, default=str) + "\n")
    return 0
