"""What a Redfish service is to polca: an endpoint to reach, and a session to GET and PATCH.

``RedfishEndpoint`` is the configuration of one Redfish service (a PDU, a CDU, a BMC):
where it is, how polca authenticates (the password only from a file or a systemd
credential, never from YAML) and how far its answers are trusted (TLS verification,
size and time bounds). ``RedfishSession`` is the seam the readers (``redfish/power.py``,
``redfish/cooling.py``, ``bmc/redfish.py``, ``meter/redfish.py``) use; the one client
that implements it over HTTP is ``redfish/client.py`` (the only module that speaks HTTP
to Redfish services). Readers take ``Mapping[str, Any]`` documents and check every value
they use: a session bounds the size and depth of a document, not its content.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["RedfishEndpoint", "RedfishSession", "SessionFactory"]


class RedfishEndpoint(BaseModel):
    """One Redfish service: its URL, credentials and the bounds on its answers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?/?$",
        max_length=256,
        description="Service address, scheme://host[:port] (the service root is "
        "/redfish/v1). http:// only with allow_http.",
    )
    username: str | None = Field(None, max_length=256, description="User for basic auth.")
    password_file: Path | None = Field(
        None,
        description="File holding the password (first line); else the systemd credential "
        "named by credential. Never in YAML.",
    )
    credential: str = Field(
        "redfish_password",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="systemd credential holding the password when password_file is unset.",
    )
    ca_file: Path | None = Field(
        None, description="CA bundle to verify the service with (default: the system's)."
    )
    verify_tls: bool = Field(
        True, description="Verify the service's certificate. Turn off only in a lab."
    )
    allow_http: bool = Field(
        False, description="Accept a plain http:// URL (labs and tests; never on a site)."
    )
    timeout_s: float = Field(5.0, gt=0, le=60, description="Bound on each request.")
    max_body_bytes: int = Field(
        1_048_576, ge=1024, le=16_777_216, description="Largest answer read; larger is refused."
    )

    @model_validator(mode="after")
    def _http_only_when_allowed(self) -> Self:
        if self.url.startswith("http://") and not self.allow_http:
            msg = f"{self.url}: plain http:// needs allow_http: true (labs and tests only)"
            raise ValueError(msg)
        return self


class RedfishSession(Protocol):
    """A logged-in Redfish service: GET and PATCH resources by their path.

    ``path`` is an ``@odata.id`` (``/redfish/v1/...``). Raises ``TransportError`` when the
    service cannot be reached, times out or answers 5xx; ``TransportAuthError`` on 401/403;
    ``ReadingRejectedError`` (``polca.errors``; reasons ``oversized``, ``malformed``,
    ``redirect``, ``not_found``, ``refused``: another 4xx, e.g. a PATCH out of range)
    when the answer cannot be used; nothing else.
    """

    async def get(self, path: str) -> Mapping[str, Any]:
        """The JSON object at ``path``."""
        ...

    async def patch(self, path: str, body: Mapping[str, Any]) -> None:
        """PATCH ``body`` to ``path`` (the caller reads the resource back to verify)."""
        ...

    async def close(self) -> None:
        """Log out (if a session was made) and close connections (idempotent)."""
        ...


class SessionFactory(Protocol):
    """Opens a logged-in session to a Redfish service (``polca.redfish.open_session``)."""

    def __call__(
        self, endpoint: RedfishEndpoint, *, password: str | None = None
    ) -> Awaitable[RedfishSession]:
        """Connect to ``endpoint``; ``TransportError``/``ConfigError`` when it cannot."""
        ...
