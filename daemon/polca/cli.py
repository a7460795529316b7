"""The ``polca`` command line: which daemon or tool to run.

Each process's own command lives with it (``agent/cli.py``, ``aggregator/cli.py``,
``meter/cli.py``, ``cdu/cli.py``, ``bmc/cli.py``, ``assign/cli.py``, ``sim/cli.py``: its
``add_parsers`` and ``main``); this module builds the parser from them, dispatches, and
holds the small tools of its own (``status``, ``demo``, ``gpu probe``, ``policy``,
``config``). A daemon's start-up (settings, logging, the exit code) is
``exits.run_process``; exit codes and the line a failed run logs are ``polca.exits``'s
(0 success, 1 failure, 2 usage, 69 broker unreachable, 77 refused, 78 configuration).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog

from polca import __version__, logs
from polca.agent import cli as agent_cli
from polca.aggregator import cli as aggregator_cli
from polca.assign import cli as assign_cli
from polca.bmc import cli as bmc_cli
from polca.cdu import cli as cdu_cli
from polca.errors import FatalError, PolcaError, TransportAuthError
from polca.exits import EX_CONFIG, EX_NOPERM, EX_UNAVAILABLE, exit_code
from polca.gpu import registry
from polca.meter import cli as meter_cli
from polca.settings import broker_override
from polca.sim import cli as sim_cli
from polca.sitectl import budget as budget_cli
from polca.sitectl import cli as site_cli

NumberT = TypeVar("NumberT", int, float)


def _checked(
    text: str,
    parse: Callable[[str], NumberT],
    noun: str,
    ok: Callable[[NumberT], bool],
    requirement: str,
) -> NumberT:
    """``text`` as a number that ``ok`` accepts, else a usage error (argparse names the
    option): "not <noun>" or "<requirement>, got <text>"."""
    try:
        value = parse(text)
    except ValueError:
        msg = f"not {noun}: {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not ok(value):
        msg = f"{requirement}, got {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    return _checked(text, int, "a whole number", lambda v: v >= 1, "must be at least 1")


def _not_negative(text: str) -> float:
    """An argparse type: a finite number of 0 or more."""
    return _checked(
        text,
        float,
        "a number",
        lambda v: v >= 0 and math.isfinite(v),
        "must be a finite number of 0 or more",
    )


def _positive(text: str) -> float:
    """An argparse type: a finite number above 0."""
    return _checked(
        text,
        float,
        "a number",
        lambda v: v > 0 and math.isfinite(v),
        "must be a finite number above 0",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polca", description="GPU power and thermal control.")
    parser.add_argument("--version", action="version", version=f"polca {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    agent_cli.add_parsers(sub)
    aggregator_cli.add_parsers(sub)
    _status_parser(sub)

    demo = sub.add_parser(
        "demo",
        help="a whole oversubscribed row on this machine: embedded broker, aggregator and "
        "simulated nodes replaying a real LLM-inference trace, shown live",
    )
    demo.add_argument("--racks", type=int, default=3)
    demo.add_argument("--nodes-per-rack", type=int, default=4)
    demo.add_argument("--model", default="H100-SXM", help="A100-SXM4, H100-SXM or H200-SXM")
    demo.add_argument(
        "--budget-w",
        type=float,
        default=None,
        help="row budget (default: 77.5%% of the row's nameplate, the smallest the planner "
        "signs for the default load and policy: bench/demo_plan.py)",
    )
    demo.add_argument("--speedup", type=float, default=2.0, help="trace time compression")
    demo.add_argument("--scale", type=float, default=16.0, help="trace load multiplier")
    demo.add_argument(
        "--offset-s",
        type=_not_negative,
        default=756.0,
        help="trace seconds skipped at the start (the largest burst of a lap comes about a "
        "minute into the run)",
    )
    demo.add_argument(
        "--tenants",
        type=_at_least_one,
        default=4,
        help="services sharing the row, each the trace at its own phase (1: the whole row "
        "follows the trace's bursts)",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--incident-at",
        type=float,
        default=45.0,
        help="seconds until a CDU pump of rack 2's cooling loop fails (negative: no incident)",
    )
    demo.add_argument(
        "--incident-s", type=float, default=30.0, help="seconds until that pump is repaired"
    )
    demo.add_argument(
        "--feed-loss-at",
        type=float,
        default=20.0,
        help="seconds until the row's feed B is lost (its PDU's breaker trips; each feed "
        "carries 60%% of the row's budget; negative: no loss)",
    )
    demo.add_argument(
        "--feed-loss-s", type=float, default=15.0, help="seconds until feed B is back"
    )
    demo.add_argument("--policy", type=Path, default=None)
    demo.add_argument("--broker", default=None, help="use this MQTT broker host[:port]")
    demo.add_argument("--influx", default=None, help="also write to InfluxDB at this URL")
    demo.add_argument(
        "--influx-api",
        choices=["v2", "v1"],
        default="v2",
        help="v2 (InfluxDB 1.8+, 2.x, 3.x, VictoriaMetrics) or v1 (InfluxDB 1.x)",
    )
    demo.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    demo.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="at the end, write row.csv (row power and level) and uncapped.csv (the "
        "uncapped counterfactual, a power history for `polca plan --history`) here",
    )
    logs.add_options(demo, level="warning", fmt=False)

    policy = sub.add_parser("policy", help="policy files")
    psub = policy.add_subparsers(dest="policy_command", required=True)
    check = psub.add_parser("check", help="validate policy files (FILE:LINE:COL errors)")
    check.add_argument("files", nargs="+", type=Path)
    psub.add_parser("schema", help="print the policy JSON Schema")

    gpu = sub.add_parser("gpu", help="GPU tools")
    gsub = gpu.add_subparsers(dest="gpu_command", required=True)
    probe = gsub.add_parser(
        "probe", help="list the GPUs, what they support and one reading (read-only)"
    )
    probe.add_argument("--backend", choices=registry.BACKEND_NAMES, default="nvml")
    probe.add_argument("--config", type=Path, default=None)

    config = sub.add_parser("config", help="configuration")
    csub = config.add_subparsers(dest="config_command", required=True)
    csub.add_parser("docs", help="print the configuration reference (Markdown)")
    csub.add_parser("show", help="print the effective settings (secrets hidden)").add_argument(
        "--config", type=Path, default=None
    )
    for tool in (cdu_cli, meter_cli, bmc_cli, assign_cli, sim_cli, site_cli, budget_cli):
        tool.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the polca command line; returns the process exit code."""
    args = _parser().parse_args(argv)
    if args.command == "policy":
        from polca.policy.check import run_check, run_schema  # noqa: PLC0415

        if args.policy_command == "check":
            return run_check(args.files, out=sys.stdout, err=sys.stderr)
        return run_schema(sys.stdout)
    if args.command == "status":
        return _status(args)
    if args.command == "cdu":
        return cdu_cli.main(args)
    if args.command == "meter":
        return meter_cli.main(args)
    if args.command == "bmc":
        return bmc_cli.main(args)
    if args.command == "site":
        return site_cli.main(args)
    if args.command == "budget":
        return budget_cli.main(args)
    if args.command == "assign":
        return assign_cli.main(args)
    if args.command in sim_cli.COMMANDS:
        return sim_cli.main(args)
    if args.command == "aggregator":
        return aggregator_cli.main(args)
    if args.command == "gpu":
        return _gpu_probe(args)
    if args.command == "config":
        from polca import settings_docs  # noqa: PLC0415

        if args.config_command == "docs":
            sys.stdout.write(settings_docs.render())
            return 0
        try:
            return settings_docs.show(args.config, out=sys.stdout)
        except FatalError as exc:
            sys.stderr.write(f"polca config show: {exc}\n")
            return EX_CONFIG
    if args.command == "demo":
        return _run_demo(args)
    return agent_cli.main(args)


def _status_parser(sub: Any) -> None:
    """``polca status``: where to connect, how, and how to print."""
    status = sub.add_parser("status", help="rows, racks and nodes from retained MQTT state")
    status.add_argument(
        "--config",
        type=Path,
        default=None,
        help="aggregator or agent settings (for the broker and site)",
    )
    status.add_argument("--broker", default=None, help="MQTT broker host[:port]")
    status.add_argument("--site", default="+", help="site name (default: every site)")
    status.add_argument(
        "--wait", type=float, default=1.0, help="seconds to collect retained messages"
    )
    status.add_argument("--username", default=None, help="MQTT user (mqtt.username)")
    status.add_argument(
        "--password-file",
        type=Path,
        default=None,
        help="file holding the MQTT password (first line); or POLCA_MQTT__PASSWORD",
    )
    status.add_argument("--tls", action="store_true", help="connect with TLS")
    status.add_argument("--ca-file", type=Path, default=None, help="CA bundle for TLS")
    status.add_argument("--json", action="store_true", help="print the snapshot as one JSON object")
    status.add_argument(
        "--timeout",
        type=_positive,
        default=5.0,
        help="seconds to wait for the broker to answer (default 5)",
    )


def _status(args: argparse.Namespace) -> int:
    """Print the retained state of the site(s)."""
    from polca.aggregator.config import AggregatorSettings  # noqa: PLC0415
    from polca.settings import load_settings_as  # noqa: PLC0415
    from polca.status import collect, render  # noqa: PLC0415

    logs.configure(level="warning")
    flags = {
        "username": args.username,
        "password_file": args.password_file,
        "tls": True if args.tls or args.ca_file else None,
        "tls_ca_file": args.ca_file,
    }
    try:
        mqtt: dict[str, Any] = broker_override(args.broker)
        mqtt.update({key: value for key, value in flags.items() if value is not None})
        over = {"mqtt": mqtt} if mqtt else {}
        settings = load_settings_as(AggregatorSettings, args.config, **over)
    except FatalError as exc:
        sys.stderr.write(f"{exc}\n")
        return EX_CONFIG
    site = args.site if args.site != "+" or args.config is None else settings.site
    try:
        snapshot = asyncio.run(
            collect(
                settings.mqtt,
                root=settings.topic_root,
                site=site,
                wait_s=args.wait,
                timeout_s=args.timeout,
            )
        )
    except TransportAuthError as exc:  # refused: retrying with the same user cannot help
        sys.stderr.write(f"{exc}\n")
        return EX_NOPERM
    except FatalError as exc:  # TLS files, protocol version
        sys.stderr.write(f"{exc}\n")
        return EX_CONFIG
    except PolcaError as exc:  # unreachable, or no answer in time
        sys.stderr.write(f"{exc}\n")
        return EX_UNAVAILABLE
    import time  # noqa: PLC0415

    if args.json:
        from polca.status import as_json  # noqa: PLC0415

        sys.stdout.write(json.dumps(as_json(snapshot, now_ns=time.time_ns()), indent=2) + "\n")
        return 0
    render(snapshot, now_ns=time.time_ns(), out=sys.stdout)
    return 0


def _gpu_probe(args: argparse.Namespace) -> int:
    """Print every GPU's identity, constraints, capabilities and one sample."""
    from dataclasses import asdict  # noqa: PLC0415

    from polca.agent.config import load_settings  # noqa: PLC0415

    logs.configure(level="warning")
    settings = load_settings(args.config, gpu={"backend": args.backend})
    backend = registry.make_backend(settings.gpu)
    try:
        infos = backend.discover()
        out = sys.stdout
        out.write(f"{len(infos)} GPU(s), backend {args.backend}\n")
        for info in infos:
            caps = [name for name, ok in asdict(info.capabilities).items() if ok]
            missing = [name for name, ok in asdict(info.capabilities).items() if not ok]
            out.write(
                f"\ngpu {info.index}: {info.name} {info.uuid}\n"
                f"  power limit min/default/max: {info.power_limit_min_mw} / "
                f"{info.power_limit_default_mw} / {info.power_limit_max_mw} mW\n"
                f"  SM clock max: {info.sm_clock_max_mhz} MHz, "
                f"{len(info.supported_sm_clocks_mhz)} lockable values\n"
                f"  supports: {', '.join(caps)}\n"
                f"  unsupported: {', '.join(missing) or '-'}\n"
            )
            try:
                sample = backend.sample(info.index)
            except PolcaError as exc:
                out.write(f"  sample failed: {exc}\n")
                continue
            out.write(
                f"  now: {sample.power_mw} mW, {sample.gpu_temp_c} C GPU, "
                f"{sample.mem_temp_c} C memory, {sample.sm_clock_mhz} MHz SM, "
                f"clock events {sample.clock_event_reasons}\n"
            )
        try:
            backend.check_write_access()
            out.write("\nwrite access: yes (clock locks and power limits can be set)\n")
        except PolcaError as exc:
            out.write(f"\nwrite access: no\n{exc}\n")
    except FatalError as exc:
        sys.stderr.write(f"{exc}\n")
        return EX_CONFIG
    finally:
        backend.close()
    return 0


def _broker_address(broker: str | None) -> tuple[str, int] | None:
    over = broker_override(broker)
    return (over["host"], int(over.get("port", 1883))) if over else None


def _run_demo(args: argparse.Namespace) -> int:
    from polca.demo.options import DEMO_POLICY, DemoOptions  # noqa: PLC0415
    from polca.demo.runtime import run_demo  # noqa: PLC0415

    logs.configure(level=args.log_level, fmt="auto", stream=sys.stderr)
    log = structlog.get_logger()
    try:
        options = DemoOptions(
            racks=args.racks,
            nodes_per_rack=args.nodes_per_rack,
            model=args.model,
            budget_w=args.budget_w,
            speedup=args.speedup,
            scale=args.scale,
            tenants=args.tenants,
            offset_s=args.offset_s,
            seed=args.seed,
            policy=args.policy or DEMO_POLICY,
            duration_s=args.duration,
            influx_url=args.influx,
            influx_api=args.influx_api,
            incident_at_s=args.incident_at if args.incident_at >= 0 else None,
            incident_s=args.incident_s,
            feed_loss_at_s=args.feed_loss_at if args.feed_loss_at >= 0 else None,
            feed_loss_s=args.feed_loss_s,
            broker=_broker_address(args.broker),
            record_dir=args.record,
        )
        asyncio.run(run_demo(options))
    except (Exception, KeyboardInterrupt) as exc:
        return exit_code(exc, log, daemon="demo")
    return 0
