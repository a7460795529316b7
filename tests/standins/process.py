"""The Redfish stand-in as a test service: a real process on a loopback port.

``RedfishStandIn`` runs ``python -m tests.standins.redfish`` with the repository root on
``PYTHONPATH`` (so the device modules import), counts it started when ``GET /redfish/v1``
answers, and drives its test-only endpoints: ``set_state``, ``fault``, ``requests``,
``reset``, ``expire_sessions``. The helpers block briefly (loopback), which is fine from
an async test: the server is another process.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.services import ServiceProcess

REPO_ROOT = Path(__file__).resolve().parents[2]


class RedfishStandIn(ServiceProcess):
    """One stand-in process serving ``devices`` (``KIND:NAME[:OPTION]``)."""

    name = "redfish-standin"

    def __init__(
        self,
        workdir: Path,
        *,
        devices: Sequence[str],
        username: str | None = None,
        password: str | None = None,
        session_service: bool = True,
        tls: tuple[Path, Path] | None = None,
        port: int | None = None,
    ) -> None:
        """``tls`` is (certificate, key) to serve HTTPS; else plain HTTP."""
        self.devices = list(devices)
        self.username, self.password = username, password
        self.session_service = session_service
        self.tls = tls
        super().__init__(workdir, port=port)

    @property
    def url(self) -> str:
        """The service's address, ``scheme://127.0.0.1:port``."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        argv = [sys.executable, "-m", "tests.standins.redfish", "--port", str(self.port)]
        if len(self.devices) > 16:
            devices_file = self.workdir / "devices.json"
            devices_file.write_text(json.dumps(self.devices), encoding="utf-8")
            argv += ["--devices-file", str(devices_file)]
        else:
            for device in self.devices:
                argv += ["--device", device]
        if self.username is not None:
            argv += ["--username", self.username, "--password", self.password or ""]
        if not self.session_service:
            argv.append("--no-session-service")
        if self.tls is not None:
            argv += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        return argv

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        return env

    def _ready(self) -> bool:
        status, _ = self._call("GET", "/redfish/v1", timeout_s=1.0)
        return status == 200

    def _call(
        self, method: str, path: str, body: Any = None, *, timeout_s: float = 10.0
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(  # noqa: S310 - our own loopback service
            self.url + path, data=data, method=method
        )
        context = None
        if self.tls is not None:
            # The control channel only: the tests check the client's verification.
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(  # noqa: S310
                request, timeout=timeout_s, context=context
            ) as response:
                status: int = response.status
                raw = response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        return status, json.loads(raw) if raw else None

    def _control(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = self._call(method, path, body)
        if status != 200:
            msg = f"stand-in {method} {path}: HTTP {status} {answer}"
            raise AssertionError(msg)
        return answer

    def set_state(self, device: str, **state: Any) -> None:
        """Change a device's state (for a bmc: ``load_w``, ``limit_w``, ...)."""
        self._control("POST", "/_standin/state", {"device": device, **state})

    def fault(self, mode: str, **opts: Any) -> None:
        """Answer hostilely from now on (``mode="none"`` ends it)."""
        self._control("POST", "/_standin/fault", {"mode": mode, **opts})

    def requests(self) -> list[dict[str, Any]]:
        """The Redfish requests served so far: method, path, status, if_match, auth."""
        answer: list[dict[str, Any]] = self._control("GET", "/_standin/log")["requests"]
        return answer

    def clear_log(self) -> None:
        """Forget the requests served so far."""
        self._control("DELETE", "/_standin/log")

    def expire_sessions(self) -> None:
        """End every Redfish session, as a BMC's session timeout would."""
        self._control("DELETE", "/_standin/sessions")

    def reset(self) -> None:
        """Devices rebuilt to their first state, fault cleared, log emptied."""
        self._control("POST", "/_standin/reset")
