"""Small readers of Redfish documents, shared by every Redfish reader of polca (pure).

A Redfish answer is untrusted: these check the structure every reader relies on (a JSON
object, its ``@odata.type``, links as paths under ``/redfish/v1``, collections with a
bounded ``Members`` list, sensor excerpts ``{"Reading": ...}``) and raise
``ReadingRejectedError`` (``malformed``, ``identity``, ``oversized``, ``unsupported``) for
anything else. Used by ``redfish/cooling.py``, ``redfish/power.py``, the pollers and the
BMC power control (``bmc/redfish.py``).

Links are the hostile part: a reader follows them, so a link that leaves ``/redfish/v1``
(another host, a scheme, a query, a dot segment, a percent-encoded dot or slash) is refused
here, before any request, whatever the session would do with it. Collections longer than
a reader's bound are refused (``oversized``), never cut short: a reader that chooses among
members must not choose among the first few only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from polca.errors import ReadingRejectedError
from polca.readings import checked_number

__all__ = [
    "as_object",
    "check_type",
    "checked_path",
    "excerpt_reading",
    "member_links",
    "odata_link",
    "resource_path",
]

_MAX_PATH_CHARS = 512
_PATH = re.compile(r"^/redfish/v1(?:/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)*/?$")


def as_object(doc: object, *, what: str) -> Mapping[str, Any]:
    """``doc`` as a mapping, or ``ReadingRejectedError`` (``malformed``).

    For the navigation documents (``ThermalEquipment``, ``PowerEquipment``) where only a
    link is used and some services omit ``@odata.type``; leaves use ``check_type``.
    """
    if not isinstance(doc, Mapping):
        msg = f"{what} is not a JSON object but {type(doc).__name__}"
        raise ReadingRejectedError(msg, reason="malformed")
    return doc


def check_type(doc: object, type_name: str, *, what: str) -> Mapping[str, Any]:
    """``doc`` as a mapping whose ``@odata.type`` is ``#<type_name>.…``, or
    ``ReadingRejectedError``.

    ``malformed`` when it is not an object or has no string ``@odata.type``; ``identity``
    when it is another resource type.
    """
    if not isinstance(doc, Mapping):
        msg = f"{what} is not a JSON object but {type(doc).__name__}"
        raise ReadingRejectedError(msg, reason="malformed")
    odata_type = doc.get("@odata.type")
    if not isinstance(odata_type, str):
        msg = f"{what} has no @odata.type"
        raise ReadingRejectedError(msg, reason="malformed")
    if not odata_type.startswith(f"#{type_name}."):
        msg = f"{what} is a {odata_type[:80]!r}, not a {type_name}"
        raise ReadingRejectedError(msg, reason="identity")
    return doc


def checked_path(path: object, *, what: str = "path") -> str:
    """``path`` unchanged if it is a path of this service under ``/redfish/v1``, else
    ``ReadingRejectedError`` (``malformed``): the one path rule, for every request the
    client sends (``redfish/client.py``) and every link a reader follows.

    Refused: a non-string, a scheme or host, a query or fragment, an empty segment, a
    ``..`` anywhere or a ``.`` segment, a percent-encoded dot or slash, a character that is
    not an RFC 3986 path character, over 512 characters.
    """
    lowered = path.lower() if isinstance(path, str) else ""
    if (
        not isinstance(path, str)
        or len(path) > _MAX_PATH_CHARS
        or not _PATH.fullmatch(path)
        or ".." in path
        or "/./" in f"{path}/"
        or "%2e" in lowered
        or "%2f" in lowered
    ):
        shown = path[:80] if isinstance(path, str) else type(path).__name__
        msg = f"{what} is not a Redfish path under /redfish/v1: {shown!r}"
        raise ReadingRejectedError(msg, reason="malformed")
    return path


def resource_path(value: object, *, what: str) -> str:
    """A link's value (an ``@odata.id``, a ``DataSourceUri``) as a path of this service
    (``checked_path``), without its trailing slash."""
    path = checked_path(value, what=what)
    return path.rstrip("/") or path


def odata_link(doc: Mapping[str, Any], key: str, *, what: str) -> str | None:
    """The path of ``doc[key]`` (``{"@odata.id": path}``); None when ``key`` is absent.

    ``ReadingRejectedError`` (``malformed``) when the link is present but not a path under
    ``/redfish/v1``.
    """
    if key not in doc or doc[key] is None:
        return None
    ref = doc[key]
    if not isinstance(ref, Mapping):
        msg = f"{what}.{key} is not a link"
        raise ReadingRejectedError(msg, reason="malformed")
    return resource_path(ref.get("@odata.id"), what=f"{what}.{key}")


def member_links(collection: object, *, what: str, limit: int) -> tuple[str, ...]:
    """The member paths of a resource collection, at most ``limit`` of them.

    ``ReadingRejectedError``: ``malformed`` when ``Members`` is not a list of links,
    ``oversized`` when it has more than ``limit`` members.
    """
    if not isinstance(collection, Mapping) or not isinstance(collection.get("Members"), list):
        msg = f"{what} is not a resource collection (no Members list)"
        raise ReadingRejectedError(msg, reason="malformed")
    members: list[object] = collection["Members"]
    if len(members) > limit:
        msg = f"{what} has {len(members)} members; polca reads at most {limit}"
        raise ReadingRejectedError(msg, reason="oversized")
    paths: list[str] = []
    for i, member in enumerate(members):
        if not isinstance(member, Mapping):
            msg = f"{what}.Members[{i}] is not a link"
            raise ReadingRejectedError(msg, reason="malformed")
        path = resource_path(member.get("@odata.id"), what=f"{what}.Members[{i}]")
        if path not in paths:
            paths.append(path)
    return tuple(paths)


def excerpt_reading(doc: Mapping[str, Any], key: str, *, low: float, high: float) -> float | None:
    """``doc[key].Reading`` within ``[low, high]``; None when ``key`` is absent.

    ``ReadingRejectedError`` when present but unusable (not an excerpt, ``null`` reading:
    ``unsupported``; see ``checked_number`` for the rest).
    """
    if key not in doc:
        return None
    excerpt = doc[key]
    if not isinstance(excerpt, Mapping):
        msg = f"{key} is not a sensor excerpt"
        raise ReadingRejectedError(msg, reason="malformed")
    reading = excerpt.get("Reading")
    if reading is None:
        msg = f"{key}.Reading is null or absent"
        raise ReadingRejectedError(msg, reason="unsupported")
    return checked_number(reading, what=f"{key}.Reading", low=low, high=high)
