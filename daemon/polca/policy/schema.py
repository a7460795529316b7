"""The policy JSON Schema, for editors and for the reference embedded in docs/policy.md.

The schema is generated from ``polca.policy.model``; docs/policy.md embeds it in a ```json
block between ``<!-- BEGIN SCHEMA -->`` and ``<!-- END SCHEMA -->``, rewritten by
``python -m polca.policy.schema_export docs/policy.md`` and checked by a test.
"""

from __future__ import annotations

import json
from typing import Any

from polca.policy.model import Policy

BEGIN_MARKER = "<!-- BEGIN SCHEMA -->"
END_MARKER = "<!-- END SCHEMA -->"
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy file."""
    return {"$schema": SCHEMA_DIALECT, **Policy.model_json_schema()}


def schema_text() -> str:
    """The schema as stable, indented JSON text, ending in a newline."""
    return json.dumps(policy_json_schema(), indent=2, ensure_ascii=False) + "\n"


def embedded_schema(document: str) -> dict[str, Any]:
    """The schema embedded in ``document`` between the markers.

    Raises:
        ValueError: the markers or the JSON block are missing or malformed.
    """
    body = _between(document)[1]
    lines = body.strip().splitlines()
    if len(lines) < 2 or lines[0].strip() != "```json" or lines[-1].strip() != "```":
        msg = "the schema block must be a ```json fenced block between the markers"
        raise ValueError(msg)
    schema: dict[str, Any] = json.loads("\n".join(lines[1:-1]))
    return schema


def with_schema(document: str) -> str:
    """``document`` with the block between the markers replaced by the current schema."""
    head, _, tail = _between(document)
    return f"{head}{BEGIN_MARKER}\n```json\n{schema_text()}```\n{END_MARKER}{tail}"


def _between(document: str) -> tuple[str, str, str]:
    begin = document.find(BEGIN_MARKER)
    end = document.find(END_MARKER)
    if begin < 0 or end < begin:
        msg = f"expected {BEGIN_MARKER} followed by {END_MARKER}"
        raise ValueError(msg)
    return (
        document[:begin],
        document[begin + len(BEGIN_MARKER) : end],
        document[end + len(END_MARKER) :],
    )
