"""A real Mosquitto on a free loopback port, for tests that need an MQTT broker.

Tests never talk to public brokers and never mock the network: each test gets its own
``/usr/sbin/mosquitto`` process with a config in a temporary directory, which it can stop,
kill and start again on the same port (broker-outage tests). CI installs Mosquitto; when it
is missing the fixtures fail with a message saying so (they never skip).

``tls=True`` (or a ``TlsFiles`` made by ``make_tls_files``) gives the broker a TLS listener
instead of plain TCP, with a throwaway CA, a server certificate for ``127.0.0.1`` and
``localhost`` and a client certificate, all made with the ``openssl`` command; adding
``require_certificate=True`` makes it mutual TLS (clients must present a certificate that
the CA signed).

The start/stop/kill lifecycle is ``tests.services.ServiceProcess``; ``free_port`` is
re-exported from there for the tests that import it from here.

Register the fixtures with ``from tests.mqtt_broker import mosquitto, mosquitto_factory``
in a ``conftest.py``.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.services import ServiceProcess, free_port, require_binary

__all__ = [
    "MOSQUITTO",
    "MOSQUITTO_PASSWD",
    "MosquittoFactory",
    "MosquittoProcess",
    "TlsFiles",
    "free_port",
    "make_tls_files",
    "mosquitto",
    "mosquitto_factory",
]

MOSQUITTO = Path("/usr/sbin/mosquitto")
MOSQUITTO_PASSWD = Path("/usr/bin/mosquitto_passwd")
_CERT_DAYS = 2  # throwaway certificates: valid from now to the day after tomorrow


@dataclasses.dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a throwaway PKI: a CA, a broker certificate and a client certificate.

    The broker certificate names ``127.0.0.1`` and ``localhost`` (CN and subjectAltName);
    the client certificate's CN is ``polca-test-client``. Keys are unencrypted P-256.
    """

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path, *, ca_name: str = "polca-test-ca") -> TlsFiles:
    """Create a CA and a server and client certificate it signed, in ``directory``.

    Uses the ``openssl`` command (EC keys: a few tens of milliseconds in all). Two calls with
    different directories give two unrelated CAs, which is how a test gets a wrong one.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail(
            "the openssl command is missing: the MQTT TLS tests make their certificates "
            "with it (apt-get install openssl)",
            pytrace=False,
        )
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        openssl,
        "req",
        "-x509",
        *new_key,
        "-keyout",
        str(files.ca_key),
        "-out",
        str(files.ca_cert),
        "-days",
        str(_CERT_DAYS),
        "-subj",
        f"/CN={ca_name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    leaves = [
        (
            files.server_cert,
            files.server_key,
            "127.0.0.1",
            "serverAuth",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ),
        (files.client_cert, files.client_key, "polca-test-client", "clientAuth", None),
    ]
    for cert, key, common_name, usage, alt_names in leaves:
        request = cert.with_suffix(".csr")
        _openssl(
            openssl,
            "req",
            *new_key,
            "-keyout",
            str(key),
            "-out",
            str(request),
            "-subj",
            f"/CN={common_name}",
        )
        # Strict X.509 checks (Python 3.13's default context) want the key identifiers.
        extensions = [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            f"extendedKeyUsage={usage}",
            "subjectKeyIdentifier=hash",
            "authorityKeyIdentifier=keyid",
        ]
        if alt_names is not None:
            extensions.append(alt_names)
        extfile = cert.with_suffix(".ext")
        extfile.write_text("\n".join(extensions) + "\n", encoding="utf-8")
        _openssl(
            openssl,
            "x509",
            "-req",
            "-in",
            str(request),
            "-CA",
            str(files.ca_cert),
            "-CAkey",
            str(files.ca_key),
            "-set_serial",
            str(int.from_bytes(os.urandom(8), "big")),
            "-days",
            str(_CERT_DAYS),
            "-extfile",
            str(extfile),
            "-out",
            str(cert),
        )
    return files


def _openssl(openssl: str, *args: str) -> None:
    """Run one openssl command; fail the test with its output if it fails."""
    result = subprocess.run(
        [openssl, *args], capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode != 0:
        pytest.fail(
            f"openssl {args[0]} failed ({result.returncode}): {result.stderr.strip()}",
            pytrace=False,
        )


class MosquittoProcess(ServiceProcess):
    """One Mosquitto broker process with its own config, on a fixed loopback port.

    ``users`` (name -> password) turns anonymous access off and writes a password file
    with ``mosquitto_passwd``. ``tls`` makes the listener TLS-only: ``True`` creates a fresh
    PKI in ``workdir``, a ``TlsFiles`` reuses one; ``require_certificate`` then asks every
    client for a certificate signed by its CA (mutual TLS). Persistence is off: a restart
    forgets retained messages.
    """

    name = "mosquitto"
    start_timeout_s = 5.0
    stop_timeout_s = 5.0
    poll_interval_s = 0.02

    def __init__(
        self,
        workdir: Path,
        *,
        users: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        tls: bool | TlsFiles = False,
        require_certificate: bool = False,
        extra_config: Sequence[str] = (),
    ) -> None:
        require_binary(
            MOSQUITTO, needed_by="the MQTT tests need a real Mosquitto", package="mosquitto"
        )
        super().__init__(workdir, host=host, port=port)
        self.conf_path = workdir / "mosquitto.conf"
        if require_certificate and tls is False:
            msg = "require_certificate needs a TLS listener (tls=True)"
            raise ValueError(msg)
        self.tls: TlsFiles | None = None
        """The PKI of the TLS listener; None for plain MQTT."""
        if isinstance(tls, TlsFiles):
            self.tls = tls
        elif tls:
            self.tls = make_tls_files(workdir / "tls")
        self._extra_config = tuple(extra_config)
        self._write_config(users, require_certificate=require_certificate)

    @property
    def url(self) -> str:
        """``mqtt://host:port``, or ``mqtts://host:port`` with TLS."""
        scheme = "mqtts" if self.tls is not None else "mqtt"
        return f"{scheme}://{self.host}:{self.port}"

    def _write_config(self, users: Mapping[str, str] | None, *, require_certificate: bool) -> None:
        lines = [
            f"listener {self.port} {self.host}",
            "persistence false",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            # Running as root, Mosquitto would switch to the "mosquitto" user and lose
            # access to our files; naming the current user keeps it as it is.
            f"user {pwd.getpwuid(os.getuid()).pw_name}",
        ]
        if self.tls is not None:
            # Listener options: they must follow the ``listener`` line.
            lines[1:1] = [
                f"cafile {self.tls.ca_cert}",
                f"certfile {self.tls.server_cert}",
                f"keyfile {self.tls.server_key}",
                f"require_certificate {str(require_certificate).lower()}",
            ]
        if users:
            password_file = self.workdir / "passwords"
            password_file.touch(mode=0o600)
            for name, password in users.items():
                subprocess.run(
                    [str(MOSQUITTO_PASSWD), "-b", str(password_file), name, password],
                    check=True,
                    capture_output=True,
                    timeout=10,
                )
            lines += ["allow_anonymous false", f"password_file {password_file}"]
        else:
            lines.append("allow_anonymous true")
        lines.extend(self._extra_config)  # e.g. queue limits for the benchmarks
        self.conf_path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def _argv(self) -> list[str]:
        return [str(MOSQUITTO), "-c", str(self.conf_path)]

    def _ready(self) -> bool:
        """Whether the broker accepts TCP connections."""
        with socket.create_connection((self.host, self.port), timeout=0.2):
            return True


MosquittoFactory = Callable[..., MosquittoProcess]


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[MosquittoFactory]:
    """Start brokers with options (``users={...}``, ``tls=...``, ``require_certificate=True``).

    All are killed after the test.
    """
    brokers: list[MosquittoProcess] = []

    def make(
        *,
        users: Mapping[str, str] | None = None,
        tls: bool | TlsFiles = False,
        require_certificate: bool = False,
    ) -> MosquittoProcess:
        broker = MosquittoProcess(
            tmp_path / f"mosquitto-{len(brokers)}",
            users=users,
            tls=tls,
            require_certificate=require_certificate,
        )
        brokers.append(broker)
        broker.start()
        return broker

    yield make
    for broker in brokers:
        broker.kill()


@pytest.fixture
def mosquitto(mosquitto_factory: MosquittoFactory) -> MosquittoProcess:
    """A running anonymous Mosquitto on a free loopback port, killed after the test."""
    return mosquitto_factory()
