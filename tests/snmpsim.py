"""A real SNMP agent for the meter tests: snmpsim serving ``tests/data/snmprec`` on loopback.

``snmpsim-command-responder`` answers v2c with community = a data file's name without
``.snmprec`` (``apc``, ``raritan``, ...) and v3 (users ``polca`` and ``prober``, SHA/AES)
with context name = that name. It runs from ``.snmpsim-venv`` (``scripts/snmpsim-env.sh``
makes it): as root, snmpsim insists on dropping to ``nobody``, who cannot run the test
venv's Python under ``/root``, so its venv is built on Debian's ``/usr/bin/python3``. For
the same reason the data files are copied into a world-readable temporary directory and
its index cache belongs to ``nobody``.

Ready means a real SNMP GET of sysObjectID and sysDescr answered, made from this process
with pysnmp (through ``polca.meter.snmp.SnmpSource``).

A test changes what a device answers with ``SnmpSimProcess.set_records`` (a UPS going on
battery, a value turning hostile): it rewrites that device's data file in the agent's copy,
which snmpsim re-reads at its next request. No SNMP SET: the UPS-MIB's state is read-only,
as on a real UPS, and only polca's own modules may import pysnmp.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import pytest

from tests.services import ServiceProcess

__all__ = [
    "DATA_DIR",
    "V3_AUTH_KEY",
    "V3_PRIV_KEY",
    "V3_PROBE_PASSWORD",
    "V3_PROBE_USER",
    "V3_USER",
    "SnmpSimProcess",
    "free_udp_port",
    "snmpsim_agent",
]

REPO: Final = Path(__file__).resolve().parent.parent
RESPONDER: Final = REPO / ".snmpsim-venv" / "bin" / "snmpsim-command-responder"
DATA_DIR: Final = Path(__file__).resolve().parent / "data" / "snmprec"
V3_USER: Final = "polca"
# Throwaway keys of the test agent, not secrets.
V3_AUTH_KEY: Final = "polca-auth-key-1"
V3_PRIV_KEY: Final = "polca-priv-key-1"
V3_PROBE_USER: Final = "prober"
V3_PROBE_PASSWORD: Final = "polca-probe-password"  # noqa: S105
_NOBODY: Final = (65534, 65534)  # nobody:nogroup on Debian


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class SnmpSimProcess(ServiceProcess):
    """snmpsim on a loopback UDP port, serving a copy of ``tests/data/snmprec``."""

    name = "snmpsim"
    start_timeout_s = 30.0

    def __init__(self, workdir: Path) -> None:
        if not RESPONDER.exists():
            pytest.fail(
                f"{RESPONDER} is missing: the SNMP meter tests need snmpsim "
                "(run scripts/snmpsim-env.sh; scripts/test.sh runs it)",
                pytrace=False,
            )
        super().__init__(workdir, port=free_udp_port())
        # World-readable for nobody (pytest's tmp_path is private to root).
        self.root = Path(tempfile.mkdtemp(prefix="polca-snmpsim-"))
        self.root.chmod(0o755)
        self.data_dir = self.root / "data"
        shutil.copytree(DATA_DIR, self.data_dir)
        for path in (self.data_dir, *self.data_dir.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        self.cache_dir = self.root / "cache"
        self.cache_dir.mkdir()
        if os.geteuid() == 0:
            os.chown(self.cache_dir, *_NOBODY)
        self._mtime_s = 0

    def set_records(self, data: str, records: Mapping[str, tuple[int, int | str] | None]) -> None:
        """Change what data file ``data`` (a community, a v3 context) answers from now on.

        Each OID maps to (tag, value) in snmprec's terms (2: Integer32, 4: OctetString, 65:
        Counter32, ...) or None to remove it (noSuchObject). snmpsim notices a data file
        whose modification time (in whole seconds) changed and indexes it again, so each
        change sets a later one than the last.
        """
        path = self.data_dir / f"{data}.snmprec"
        lines: dict[str, str] = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            oid, rest = line.split("|", 1)
            lines[oid] = rest
        for oid, record in records.items():
            if record is None:
                lines.pop(oid, None)
            else:
                lines[oid] = f"{record[0]}|{record[1]}"
        ordered = sorted(lines, key=lambda oid: tuple(int(arc) for arc in oid.split(".")))
        staged = self.root / f"{data}.staged"  # outside the data directory snmpsim reads
        staged.write_text("".join(f"{oid}|{lines[oid]}\n" for oid in ordered), encoding="utf-8")
        staged.chmod(0o644)
        self._mtime_s = max(int(time.time()) + 1, self._mtime_s + 1)
        os.utime(staged, (self._mtime_s, self._mtime_s))
        staged.replace(path)

    def _argv(self) -> list[str]:
        argv = [
            str(RESPONDER),
            f"--data-dir={self.data_dir}",
            f"--cache-dir={self.cache_dir}",
            f"--agent-udpv4-endpoint={self.host}:{self.port}",
            f"--v3-user={V3_USER}",
            f"--v3-auth-key={V3_AUTH_KEY}",
            "--v3-auth-proto=SHA",
            f"--v3-priv-key={V3_PRIV_KEY}",
            "--v3-priv-proto=AES",
            # The probe's user: one password for both keys, as ``polca meter probe`` sends.
            f"--v3-user={V3_PROBE_USER}",
            f"--v3-auth-key={V3_PROBE_PASSWORD}",
            "--v3-auth-proto=SHA",
            f"--v3-priv-key={V3_PROBE_PASSWORD}",
            "--v3-priv-proto=AES",
        ]
        if os.geteuid() == 0:
            argv += ["--process-user=nobody", "--process-group=nogroup"]
        return argv

    def _ready(self) -> bool:
        if "Listening at UDP" not in self.log_tail(200):
            return False
        return asyncio.run(_answers(self.host, self.port))

    def cleanup(self) -> None:
        """Kill the agent and remove its data copy."""
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


async def _answers(host: str, port: int) -> bool:
    """Whether a v2c GET of sysObjectID and sysDescr (community ``apc``) is answered."""
    from polca.errors import TransportError
    from polca.meter.snmp import SnmpSource, SnmpSourceConfig

    config = SnmpSourceConfig(
        protocol="snmp", name="ready", host=host, port=port, timeout_s=0.3, retries=0
    )
    source = SnmpSource(config, community="apc")
    try:
        identity = await source.discover()
    except TransportError:
        return False
    finally:
        await source.close()
    return identity.sys_object_id is not None


def snmpsim_agent(workdir: Path) -> Iterator[SnmpSimProcess]:
    """Start an agent, yield it, kill it and remove its files: a fixture's body."""
    agent = SnmpSimProcess(workdir)
    try:
        agent.start()
        yield agent
    finally:
        agent.cleanup()
