"""Fixtures of the BMC tests: the stand-in (``tests/standins/fixtures.py``)."""

from tests.standins.fixtures import (
    _bmc_processes,
    _redfish_process,
    bmc_standin,
    redfish_standin,
    standin_factory,
    tls_files,
)

__all__ = [
    "_bmc_processes",
    "_redfish_process",
    "bmc_standin",
    "redfish_standin",
    "standin_factory",
    "tls_files",
]
