"""Regenerate the payload JSON Schemas embedded in ``docs/mqtt.md``.

``python -m polca.telemetry.schema_docs docs/mqtt.md`` rewrites the block between
``<!-- BEGIN SCHEMAS -->`` and ``<!-- END SCHEMAS -->``; ``--check`` only reports a stale
block (exit 1). A test runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from polca.telemetry.schema import json_schemas

BEGIN = "<!-- BEGIN SCHEMAS -->"
END = "<!-- END SCHEMAS -->"


def render_block() -> str:
    """The generated Markdown: one JSON Schema per payload kind."""
    parts = [BEGIN, ""]
    for name, schema in json_schemas().items():
        parts += [
            f"### {name}",
            "",
            "```json",
            json.dumps(schema, indent=2, sort_keys=True),
            "```",
            "",
        ]
    parts.append(END)
    return "\n".join(parts)


def with_schemas(document: str) -> str:
    """``document`` with its schema block replaced by the current one."""
    start = document.index(BEGIN)
    stop = document.index(END) + len(END)
    return document[:start] + render_block() + document[stop:]


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` verify) the schema block of the given documents."""
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    stale = 0
    for path in (Path(a) for a in args if a != "--check"):
        document = path.read_text(encoding="utf-8")
        updated = with_schemas(document)
        if updated != document:
            if check:
                sys.stderr.write(f"{path}: the embedded MQTT schemas are out of date\n")
                stale += 1
            else:
                path.write_text(updated, encoding="utf-8")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
