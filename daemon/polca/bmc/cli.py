"""``polca bmc``: read, cap and restore one node's power limit through its BMC (Redfish).

- ``polca bmc probe URL``: discover the power control and print one reading,
  ``{"power_w", "limit_w", "limit_min_w", "limit_max_w", "control", "units", "controls"}``:
  ``controls`` lists every power control seen on the chassis (``path``,
  ``physical_context``, ``units``, ``chosen``, ``why``);
- ``polca bmc cap URL --watts W``: write the limit, read it back, print
  ``{"limit_w", "verified"}``;
- ``polca bmc restore URL``: lift the cap (the allowable maximum), read it back, print the
  same.

Each prints one JSON object on stdout. URLs are ``https://host[:port]`` (TLS verified with
the system's CAs or ``--ca-file``; ``--insecure`` turns verification off, for a lab) or
``http://`` (labs and tests). ``--username`` with ``--password-file`` (or the systemd
credential ``redfish_password``) logs in. ``--control`` names the power control where a
chassis has several that discovery cannot tell apart. On failure: one line on stderr, never a
traceback, and an exit code saying what went wrong: ``EX_USAGE`` (2) a bad argument;
``EX_DATAERR`` (65) the BMC answered with something unusable; ``EX_UNAVAILABLE`` (69)
unreachable, timed out or 5xx; ``EX_PROTOCOL`` (76) a cap or restore the BMC accepted but
does not report (the JSON is printed too); ``EX_NOPERM`` (77) credentials refused;
``EX_CONFIG`` (78) a configuration problem or a cap outside the allowable range (nothing
written); ``EX_FAILURE`` (1) anything else.

``polca.cli`` wires these in with ``add_parsers(sub)`` and ``main(args)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from polca.exits import (
    EX_CONFIG,
    EX_FAILURE,
    EX_INTERRUPTED,
    EX_PROTOCOL,
    EX_USAGE,
    one_shot_code,
)

__all__ = ["add_parsers", "main"]

"""sysexits: the BMC accepted a write and reports another value."""


def add_parsers(subparsers: Any) -> None:
    """Add ``bmc probe``, ``bmc cap`` and ``bmc restore`` to the ``polca`` sub-commands."""
    bmc = subparsers.add_parser("bmc", help="out-of-band power limits through a BMC (Redfish)")
    bsub = bmc.add_subparsers(dest="bmc_command", required=True)
    probe = bsub.add_parser("probe", help="discover the power control and print one reading")
    _common(probe)
    cap = bsub.add_parser("cap", help="set the node's power limit and read it back")
    _common(cap)
    cap.add_argument("--watts", type=float, required=True, help="the limit to set, in W")
    restore = bsub.add_parser("restore", help="lift the cap (allowable maximum), read it back")
    _common(restore)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="the BMC, https://host[:port] (http:// in labs)")
    p.add_argument("--username", default=None, help="Redfish user (session, else basic auth)")
    p.add_argument(
        "--password-file", type=Path, default=None, help="file whose first line is the password"
    )
    p.add_argument("--ca-file", type=Path, default=None, help="CA bundle to verify the BMC with")
    p.add_argument(
        "--insecure", action="store_true", help="do not verify the BMC's certificate (lab only)"
    )
    p.add_argument("--timeout", type=float, default=5.0, help="bound on each request, seconds")
    p.add_argument(
        "--control",
        default=None,
        help="the power control to use (path or last segment) when a chassis has several",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``polca bmc ...``; returns the exit code."""
    from pydantic import ValidationError  # noqa: PLC0415 - only for bmc commands

    from polca.errors import PolcaError  # noqa: PLC0415
    from polca.redfish.api import RedfishEndpoint  # noqa: PLC0415

    watts = getattr(args, "watts", None)
    if watts is not None and not (math.isfinite(watts) and watts > 0):
        return _fail(f"--watts must be a positive number of watts, not {watts}", EX_USAGE)
    try:
        endpoint = RedfishEndpoint(
            url=args.url,
            username=args.username,
            password_file=args.password_file,
            ca_file=args.ca_file,
            verify_tls=not args.insecure,
            allow_http=str(args.url).startswith("http://"),
            timeout_s=args.timeout,
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"URL {args.url!r} is not https://host[:port] (http:// in a lab)"
            if e["loc"] == ("url",)
            else f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
            for e in exc.errors()
        )
        return _fail(f"bad BMC address or option: {problems}", EX_CONFIG)
    try:
        answer, verified = asyncio.run(
            _run(args.bmc_command, endpoint, watts, getattr(args, "control", None))
        )
    except KeyboardInterrupt:
        return EX_INTERRUPTED
    except PolcaError as exc:
        return _fail(_describe(exc), one_shot_code(exc))
    except Exception as exc:  # a one-shot command ends with one line, never a traceback
        return _fail(f"unexpected {type(exc).__name__}: {exc}", EX_FAILURE)
    sys.stdout.write(json.dumps(answer) + "\n")
    if not verified:
        return _fail(
            f"the BMC reports a limit of {answer['limit_w']} W, not the one written", EX_PROTOCOL
        )
    return 0


async def _run(
    command: str, endpoint: Any, watts: float | None, named: str | None = None
) -> tuple[dict[str, Any], bool]:
    """The JSON answer of ``command`` and whether it was verified (always, for probe)."""
    from polca.bmc.redfish import UNITS_W, BmcPowerControl  # noqa: PLC0415
    from polca.redfish.client import connect  # noqa: PLC0415

    session = await connect(endpoint)
    try:
        control = BmcPowerControl(session, control=named)
        if command == "probe":
            reading = await control.read()
            shape = await control.discover()
            units = next((u for u, w in UNITS_W.items() if w == shape.w_per_unit), "W")
            return {
                "power_w": reading.power_w,
                "limit_w": reading.limit_w,
                "limit_min_w": reading.limit_min_w,
                "limit_max_w": reading.limit_max_w,
                "control": reading.control,
                "units": units,
                "controls": [
                    {
                        "path": seen.path,
                        "physical_context": seen.physical_context,
                        "units": seen.units,
                        "chosen": seen.chosen,
                        "why": seen.why,
                    }
                    for seen in shape.seen
                ],
            }, True
        if command == "cap":
            assert watts is not None  # noqa: S101 - --watts is required by argparse
            result = await control.cap(watts)
        else:
            result = await control.restore()
        return {"limit_w": result.limit_w, "verified": result.verified}, result.verified
    finally:
        await session.close()


def _describe(exc: Exception) -> str:
    """The stderr line of a failure, led by what kind of failure it is."""
    from polca.errors import ReadingRejectedError, TransportAuthError, TransportError  # noqa: PLC0415

    if isinstance(exc, TransportAuthError):  # before TransportError: it is one
        return f"credentials refused: {exc}"
    if isinstance(exc, TransportError):
        return f"BMC unreachable: {exc}"
    if isinstance(exc, ReadingRejectedError):
        return f"unusable answer ({exc.reason}): {exc}"
    return str(exc)


def _fail(line: str, code: int) -> int:
    """Write ``line`` (one line) on stderr and return ``code``."""
    sys.stderr.write(" ".join(line.split())[:1000] + "\n")
    return code
