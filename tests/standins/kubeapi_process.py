"""The Kubernetes API stand-in as a test service: a real process on a loopback port.

``KubeApiStandIn`` runs ``python -m tests.standins.kubeapi`` with the repository root on
``PYTHONPATH``, counts it started when ``GET /_standin/health`` answers, and drives its
test-only endpoints: ``put_pod``/``put_pods``, ``delete_pod``, ``fault``, ``stats``. The
helpers block briefly (loopback), which is fine from an async test: the server is another
process. ``make_pod`` builds a pod as the API would hold it.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.services import ServiceProcess

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_pod(
    namespace: str,
    name: str,
    *,
    node: str,
    uid: str | None = None,
    labels: Mapping[str, Any] | None = None,
    annotations: Mapping[str, Any] | None = None,
    priority: Any = None,
    phase: str = "Running",
) -> dict[str, Any]:
    """A pod bound to ``node`` (the store fills in uid, resourceVersion, timestamps)."""
    metadata: dict[str, Any] = {"namespace": namespace, "name": name}
    if uid is not None:
        metadata["uid"] = uid
    if labels is not None:
        metadata["labels"] = dict(labels)
    if annotations is not None:
        metadata["annotations"] = dict(annotations)
    spec: dict[str, Any] = {
        "nodeName": node,
        "containers": [{"name": "main", "image": "registry.example/train:1"}],
    }
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": metadata, "spec": spec, "status": {"phase": phase}}


class KubeApiStandIn(ServiceProcess):
    """One stand-in API server accepting ``token``, holding ``pods`` at start."""

    name = "kubeapi-standin"

    def __init__(
        self,
        workdir: Path,
        *,
        token: str,
        pods: Sequence[Mapping[str, Any]] = (),
        tls: tuple[Path, Path] | None = None,
        port: int | None = None,
    ) -> None:
        """``pods`` are written to a state file the process loads at start; ``tls`` is
        (certificate, key) to serve HTTPS, else plain HTTP."""
        self.token = token
        self.initial_pods = [dict(p) for p in pods]
        self.tls = tls
        super().__init__(workdir, port=port)

    @property
    def url(self) -> str:
        """The API's address, ``http(s)://127.0.0.1:port``."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        argv = [sys.executable, "-m", "tests.standins.kubeapi", "--port", str(self.port)]
        argv += ["--token", self.token]
        if self.initial_pods:
            state = self.workdir / "pods.json"
            state.write_text(json.dumps(self.initial_pods), encoding="utf-8")
            argv += ["--state", str(state)]
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
        status, _ = self._call("GET", "/_standin/health", timeout_s=1.0)
        return status == 200

    def _call(
        self, method: str, path: str, body: bytes | None = None, *, timeout_s: float = 10.0
    ) -> tuple[int, bytes]:
        request = urllib.request.Request(  # noqa: S310 - our own loopback service
            self.url + path, data=body, method=method
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
                return status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def _control(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        status, raw = self._call(method, path, data)
        if status != 200:
            msg = f"stand-in {method} {path}: HTTP {status} {raw[:300]!r}"
            raise AssertionError(msg)
        return json.loads(raw)

    def put_pods(self, pods: Sequence[Mapping[str, Any]], *, leaky: bool = False) -> list[str]:
        """Create or replace pods (watches see ADDED or MODIFIED); their uids."""
        answer = self._control("POST", "/_standin/pods", {"put": list(pods), "leaky": leaky})
        uids: list[str] = answer["uids"]
        return uids

    def put_pod(self, namespace: str, name: str, *, node: str, **fields: Any) -> str:
        """Create or replace one pod (``make_pod``'s fields); its uid."""
        return self.put_pods([make_pod(namespace, name, node=node, **fields)])[0]

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete a pod (watches see DELETED)."""
        self._control(
            "POST", "/_standin/pods", {"delete": [{"namespace": namespace, "name": name}]}
        )

    def fault(self, mode: str, **opts: Any) -> None:
        """``none``, ``outage`` (``close="abort"|"eof"``), ``gone``, ``hostile`` (``node=``)."""
        self._control("POST", "/_standin/fault", {"mode": mode, **opts})

    def stats(self) -> dict[str, Any]:
        """Lists and watches served, watches open, the resourceVersion."""
        answer: dict[str, Any] = self._control("GET", "/_standin/stats")
        return answer
