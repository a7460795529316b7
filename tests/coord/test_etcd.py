"""Leader election against a real 3-member etcd cluster (etcd-server, loopback ports)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from polca.coord.etcd import Elector, EtcdClient, EtcdError, _holder, _int
from polca.coord.leadership import Leadership
from tests.etcd import EtcdCluster

TTL_S = 2.0
KEY = "polca/v1/leader/site/row1"


def _elector(cluster: EtcdCluster, instance: str, changes: list[str]) -> Elector:
    leadership = Leadership.standby()
    return Elector(
        client=EtcdClient(cluster.endpoints, timeout_s=0.5),
        key=KEY,
        instance=instance,
        leadership=leadership,
        ttl_s=TTL_S,
        poll_s=0.2,
        on_change=lambda: changes.append(f"{instance}:{leadership.role}:{leadership.leader}"),
    )


@contextlib.asynccontextmanager
async def _running(*electors: Elector) -> AsyncIterator[dict[str, asyncio.Task[None]]]:
    tasks = {e.instance: asyncio.create_task(e.run()) for e in electors}
    try:
        yield tasks
    finally:
        for task in tasks.values():
            task.cancel()
        for task in tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for e in electors:
            await e.client.close()


async def _until(predicate: object, timeout_s: float) -> float:
    """Seconds until ``predicate()`` holds (fails the test after ``timeout_s``)."""
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"not within {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def _leaders(*electors: Elector) -> list[str]:
    now = time.monotonic_ns()
    return [e.instance for e in electors if e.leadership.may_publish(now)]


async def test_two_instances_started_at_once_exactly_one_leads(etcd: EtcdCluster) -> None:
    """Both campaign from the first round; one wins, the other sees it, for as long as
    they run (sampled for 3 s, one lease ttl and a half)."""
    changes: list[str] = []
    a, b = _elector(etcd, "agg-a", changes), _elector(etcd, "agg-b", changes)
    async with _running(a, b):
        await _until(lambda: len(_leaders(a, b)) == 1, 5.0)
        (leader,) = _leaders(a, b)
        other = b if leader == "agg-a" else a
        await _until(lambda: other.leadership.leader == leader, 2.0)
        for _ in range(30):
            assert _leaders(a, b) == [leader]
            await asyncio.sleep(0.1)
        winner = a if leader == "agg-a" else b
        assert other.leadership.leader_term == winner.leadership.term > 0


async def test_a_dead_leader_is_replaced_within_the_ttl_at_a_higher_term(
    etcd: EtcdCluster,
) -> None:
    """The leader stops keeping its lease alive (its process died): the standby leads
    within the ttl and a campaign, with a term above the dead one's; the dead leader's
    own deadline passed before that (no two leaders at any instant)."""
    changes: list[str] = []
    a, b = _elector(etcd, "agg-a", changes), _elector(etcd, "agg-b", changes)
    async with _running(a) as tasks:
        await _until(lambda: a.leadership.role == "leader", 5.0)
        async with _running(b):
            await _until(lambda: b.leadership.leader == "agg-a", 2.0)
            old_term, old_deadline = a.leadership.term, a.leadership.deadline_mono_ns
            tasks["agg-a"].cancel()  # dies: no revoke, no keepalive
            died = time.monotonic()
            await _until(lambda: b.leadership.role == "leader", TTL_S + 6.0)
            took_s = time.monotonic() - died
            assert b.leadership.term > old_term
            assert time.monotonic_ns() > old_deadline  # the old leader had stopped first
            # The ttl and a campaign round or two; the margin is for a loaded machine (the
            # safety property is the line above, which no delay can make pass wrongly).
            assert took_s <= TTL_S + 4.0, took_s


async def test_a_clean_stop_hands_over_at_the_next_campaign(etcd: EtcdCluster) -> None:
    """``resign`` revokes the lease: the standby leads within a campaign interval or two."""
    changes: list[str] = []
    a, b = _elector(etcd, "agg-a", changes), _elector(etcd, "agg-b", changes)
    async with _running(a) as tasks:
        await _until(lambda: a.leadership.role == "leader", 5.0)
        async with _running(b):
            await _until(lambda: b.leadership.leader == "agg-a", 2.0)
            tasks["agg-a"].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tasks["agg-a"]
            await a.resign()
            took_s = await _until(lambda: b.leadership.role == "leader", TTL_S + 4.0)
            assert took_s < TTL_S  # a resign hands over before the lease would have expired
            assert not a.leadership.may_publish(time.monotonic_ns())


async def test_member_loss_changes_nothing_and_quorum_loss_stops_the_leader(
    etcd: EtcdCluster,
) -> None:
    """One member of three stopped: the same leader, the same term. Two stopped (no
    quorum): the leader cannot renew and stops publishing within its deadline. The
    members back: a leader publishes again."""
    changes: list[str] = []
    a, b = _elector(etcd, "agg-a", changes), _elector(etcd, "agg-b", changes)
    async with _running(a, b):
        await _until(lambda: len(_leaders(a, b)) == 1, 5.0)
        (first,) = _leaders(a, b)
        leader = a if first == "agg-a" else b
        term = leader.leadership.term
        await asyncio.to_thread(etcd.members[0].kill)
        for _ in range(30):  # 3 s: past a lease ttl
            assert _leaders(a, b) == [first]
            await asyncio.sleep(0.1)
        assert leader.leadership.term == term
        await asyncio.to_thread(etcd.members[1].kill)
        # etcd's leader renews leases on its own until it notices it lost the quorum
        # (one election timeout, 0.5 s here); the polca leader's deadline runs from then.
        killed_ns = time.monotonic_ns()
        deadlines = [leader.leadership.deadline_mono_ns]

        def stopped() -> bool:
            deadlines.append(leader.leadership.deadline_mono_ns)
            return not _leaders(a, b)

        await _until(stopped, TTL_S + 6.0)
        # Stopping is a deadline on the monotonic clock, not a task that must run in time:
        # the leader's last deadline lies within etcd's notice (0.5 s), a keepalive round
        # and its safety fraction of the ttl after the quorum went, however late the poll.
        assert max(deadlines) <= killed_ns + int((TTL_S + 1.5) * 1e9)
        for _ in range(10):
            assert not _leaders(a, b)  # no one leads without a quorum
            await asyncio.sleep(0.1)
        await asyncio.to_thread(etcd.members[0].start)
        await asyncio.to_thread(etcd.members[1].start)
        await asyncio.to_thread(etcd.wait_healthy)
        await _until(lambda: len(_leaders(a, b)) == 1, 15.0)


def test_hostile_answers_are_etcd_errors_not_crashes() -> None:
    """What a broken or hostile endpoint might answer becomes an EtcdError."""
    with pytest.raises(EtcdError):
        _int("12x", what="revision")
    with pytest.raises(EtcdError):
        _int(True, what="revision")
    with pytest.raises(EtcdError):
        _int(str(2**63), what="revision")
    with pytest.raises(EtcdError):
        _holder({"value": "not base64!", "create_revision": "3"})
    with pytest.raises(EtcdError):
        _holder({"value": "//79", "create_revision": "3"})  # not UTF-8
    with pytest.raises(EtcdError):
        _holder(["a list"])
    with pytest.raises(EtcdError):
        _holder({"value": "QQ==" * 200})
    assert _holder({"value": "YWdnLWE=", "create_revision": "7", "lease": "9"}).term == 7


async def test_an_unreachable_endpoint_costs_one_timeout_not_the_election(
    etcd: EtcdCluster,
) -> None:
    """A dead endpoint first in the list: the client moves on to a live one."""
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    client = EtcdClient([dead, *etcd.endpoints], timeout_s=0.5)
    try:
        lease, ttl = await client.grant(TTL_S)
        assert lease > 0
        assert ttl >= TTL_S
        assert await client.keepalive(lease)
        await client.revoke(lease)
        assert not await client.keepalive(lease)
    finally:
        await client.close()
    nowhere = EtcdClient([dead], timeout_s=0.3)
    try:
        with pytest.raises(EtcdError, match=r"127\.0\.0\.1:9"):
            await nowhere.grant(TTL_S)
    finally:
        await nowhere.close()
