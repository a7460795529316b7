"""Out-of-band writes against the Redfish stand-in: cap, verify, release, retry, pace."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from polca.bmc.actuator import BmcActuator, OobOutcome
from polca.bmc.config import BmcSettings
from polca.bmc.plan import OobTarget
from polca.bmc.redfish import BmcPowerControl
from polca.redfish.api import RedfishEndpoint
from polca.redfish.client import connect
from tests.standins.fixtures import PASSWORD, USERNAME
from tests.standins.process import RedfishStandIn


def _settings(standin: RedfishStandIn, tmp_path: Path, **over: object) -> BmcSettings:
    secret = tmp_path / "bmc.pass"
    secret.write_text(PASSWORD + "\n", encoding="utf-8")
    endpoint = {
        "url": standin.url,
        "username": USERNAME,
        "password_file": str(secret),
        "allow_http": True,
        "timeout_s": 2.0,
    }
    return BmcSettings.model_validate(
        {
            "min_write_interval_s": 0.3,
            "nodes": {"node1": {"endpoint": endpoint, "fail_safe_w": 800.0, "brake_w": 500.0}},
        }
        | over
    )


async def _limit_w(standin: RedfishStandIn) -> float | None:
    endpoint = RedfishEndpoint(url=standin.url, username=USERNAME, allow_http=True)
    session = await connect(endpoint, password=PASSWORD)
    try:
        reading = await BmcPowerControl(session).read()
        return reading.limit_w
    finally:
        await session.close()


class Outcomes:
    """What the actuator reported, with a way to wait for the next."""

    def __init__(self) -> None:
        self.seen: list[OobOutcome] = []
        self.changed = asyncio.Event()

    def __call__(self, outcome: OobOutcome) -> None:
        self.seen.append(outcome)
        self.changed.set()

    async def until(self, pred: object, timeout_s: float = 10.0) -> OobOutcome:
        assert callable(pred)
        async with asyncio.timeout(timeout_s):
            while True:
                for outcome in self.seen:
                    if pred(outcome):
                        return outcome
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def running(
    bmc_standin: RedfishStandIn, tmp_path: Path
) -> tuple[BmcActuator, Outcomes, RedfishStandIn]:
    outcomes = Outcomes()
    actuator = BmcActuator(_settings(bmc_standin, tmp_path), on_outcome=outcomes)
    return actuator, outcomes, bmc_standin


async def test_a_cap_is_written_verified_and_released_to_the_limit_found_before(
    running: tuple[BmcActuator, Outcomes, RedfishStandIn],
) -> None:
    actuator, outcomes, standin = running
    task = asyncio.create_task(actuator.run())
    try:
        actuator.want(OobTarget("node1", 800.0, "agent offline at level 2"))
        capped = await outcomes.until(lambda o: o.action == "cap")
        assert (capped.verified, capped.limit_w, capped.error) == (True, 800.0, None)
        assert capped.latency_s < 5.0
        assert await _limit_w(standin) == 800.0
        assert actuator.pending() == []
        actuator.want(OobTarget("node1", None, "agent back in control and scope released"))
        released = await outcomes.until(lambda o: o.action == "release")
        assert released.verified
        assert released.target_w == 1200.0  # the limit in force before polca capped
        assert await _limit_w(standin) == 1200.0
        actuator.want(OobTarget("node-without-bmc", 100.0, "ignored"))
        assert actuator.pending() == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await actuator.close()


async def test_a_lying_bmc_is_retried_at_the_write_pace_until_it_holds_the_limit(
    running: tuple[BmcActuator, Outcomes, RedfishStandIn],
) -> None:
    actuator, outcomes, standin = running
    standin.fault("liar")
    task = asyncio.create_task(actuator.run())
    try:
        actuator.want(OobTarget("node1", 800.0, "agent stale at level 2"))
        await outcomes.until(lambda o: not o.verified)
        await outcomes.until(lambda o: len(outcomes.seen) >= 2)
        unverified = [o for o in outcomes.seen if not o.verified]
        assert len(unverified) >= 2
        assert all(o.limit_w == 1200.0 for o in unverified)  # what it keeps reporting
        assert actuator.pending() == ["node1"]
        standin.fault("none")
        done = await outcomes.until(lambda o: o.verified)
        assert done.limit_w == 800.0
        writes = [r for r in standin.requests() if r["method"] == "PATCH"]
        assert len(writes) == len(outcomes.seen)  # one write per outcome, none lost
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await actuator.close()


async def test_an_unreachable_bmc_is_an_outcome_and_the_write_comes_when_it_answers(
    running: tuple[BmcActuator, Outcomes, RedfishStandIn],
) -> None:
    actuator, outcomes, standin = running
    standin.fault("error500")
    task = asyncio.create_task(actuator.run())
    try:
        actuator.want(OobTarget("node1", 500.0, "agent offline at level 3 (brake)"))
        failed = await outcomes.until(lambda o: o.error is not None)
        assert failed.limit_w is None
        assert not failed.verified
        standin.fault("none")
        done = await outcomes.until(lambda o: o.verified)
        assert done.limit_w == 500.0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await actuator.close()


async def test_writes_to_one_bmc_keep_their_pace_and_the_latest_target_wins(
    bmc_standin: RedfishStandIn, tmp_path: Path
) -> None:
    outcomes = Outcomes()
    actuator = BmcActuator(
        _settings(bmc_standin, tmp_path, min_write_interval_s=1.0), on_outcome=outcomes
    )
    task = asyncio.create_task(actuator.run())
    try:
        actuator.want(OobTarget("node1", 800.0, "first"))
        await outcomes.until(lambda o: o.reason == "first")
        started = time.monotonic()
        actuator.want(OobTarget("node1", 700.0, "second"))
        actuator.want(OobTarget("node1", 500.0, "third"))  # replaces the second unwritten
        third = await outcomes.until(lambda o: o.reason == "third")
        assert time.monotonic() - started >= 0.8  # the pace held
        assert third.limit_w == 500.0
        assert [o.reason for o in outcomes.seen] == ["first", "third"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await actuator.close()


@pytest.mark.parametrize(
    ("action", "error", "verified", "level", "event"),
    [
        ("cap", None, True, "warning", "oob_cap_applied"),
        ("release", None, True, "info", "oob_release_applied"),
        ("release", None, False, "warning", "oob_release_failed"),
        ("cap", "timed out", False, "warning", "oob_cap_failed"),
    ],
)
def test_an_outcome_is_logged_as_what_an_operator_must_know(
    action: str, error: str | None, verified: bool, level: str, event: str
) -> None:
    """A cap held by a BMC, or any failed write, is a warning; a verified release, info."""
    outcome = OobOutcome(
        "n1", action, 300.0, 300.0 if verified else None, verified, error, "r", 1.5
    )
    got_level, got_event, fields = outcome.log_line()
    assert (got_level, got_event) == (level, event)
    assert fields["node"] == "n1"
    assert fields["error"] == error


def test_a_wanted_target_is_a_warning_naming_cap_or_release() -> None:
    assert OobTarget("n1", 300.0, "agent stale").log_line() == (
        "warning",
        "oob_cap_wanted",
        {"node": "n1", "watts": 300.0, "reason": "agent stale"},
    )
    assert OobTarget("n1", None, "agent back").log_line()[1] == "oob_release_wanted"
