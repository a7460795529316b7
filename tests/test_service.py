"""What both daemons' shells share (``polca.service``): the shutdown's bounds and steps."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import structlog
from structlog.testing import capture_logs

from polca import service
from polca.agent.config import AgentSettings
from polca.aggregator.config import IntakeSettings

ROOT = Path(__file__).resolve().parent.parent


def _stop_s(unit: str) -> float:
    text = (ROOT / "systemd" / unit).read_text(encoding="utf-8")
    found = re.search(r"^TimeoutStopSec=(\d+)s?$", text, re.MULTILINE)
    assert found, f"TimeoutStopSec= in {unit}"
    return float(found.group(1))


def test_each_unit_leaves_room_for_its_whole_shutdown() -> None:
    """systemd kills a daemon after TimeoutStopSec: the sum of its bounded steps (with the
    GPUs' own default bound for the agent) must fit, or the last words are cut off."""
    bounds = service.STOP_BOUNDS
    agent_s = bounds.agent_s(AgentSettings().stop_timeout_s)
    assert agent_s < _stop_s("polca-agent.service"), agent_s
    # Its intake connections, the sources' and the quarantine one.
    connections = IntakeSettings().connections + 2
    assert bounds.aggregator_s(connections) < _stop_s("polca-aggregator.service")


async def test_a_step_past_its_bound_is_abandoned_and_logged() -> None:
    """A step that never ends is cancelled at its bound, logged once with the bound; a
    quick one finishes."""
    never = asyncio.Event()
    with capture_logs() as logs:
        log = structlog.get_logger()
        done = await service.bounded(never.wait(), 0.05, "final_status_not_sent", log)
        quick = await service.bounded(asyncio.sleep(0), 1.0, "unused", log)
    assert (done, quick) == (False, True)
    assert logs == [{"event": "final_status_not_sent", "timeout_s": 0.05, "log_level": "warning"}]
