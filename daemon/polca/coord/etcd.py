"""Leader election on etcd v3, through etcd's JSON gateway: the only importer of aiohttp here.

Why the gateway and not a gRPC client: every etcd v3 server (3.4 on Debian 12 included)
serves its API as JSON over HTTP at ``/v3/...``; polca already ships ``aiohttp`` for the
InfluxDB 1.x transport, while the Python gRPC clients for etcd are either unmaintained
(``etcd3``, pinned to an old protobuf) or thin (``aetcd``) and all pull in ``grpcio``, a
large compiled dependency, for five calls: lease grant, keepalive and revoke, one
transaction, one range read.

The election (one key per shard, ``{prefix}/{shard}/leader``): each member holds its own
lease (ttl ``ttl_s``, kept alive every ``ttl_s / 4``) and campaigns with one transaction,
"create the key with my lease if it does not exist, else tell me who holds it". The winner
leads while its lease lives; the term is the revision that created the key. A member that
died stops keeping its lease alive; etcd deletes the key ``ttl_s`` later and a standby's
next campaign (every ``poll_s``) wins. A leader that cannot renew within its deadline
(``polca.coord.leadership``) stops publishing at once and, once etcd answers again,
campaigns like anyone else.

Every answer is bounded (``MAX_RESPONSE_BYTES``) and parsed into strict models; an answer
that does not parse is an ``EtcdError`` like an unreachable endpoint, never a crash.
Endpoints are tried in turn: a member that is down costs one timeout, not the election.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import structlog

from polca.coord.config import HaSettings
from polca.coord.leadership import Leadership
from polca.errors import RetryableError

MAX_RESPONSE_BYTES: Final = 64 * 1024
MAX_VALUE_CHARS: Final = 256


class EtcdError(RetryableError):
    """etcd is unreachable, refused a request, or answered something that does not parse."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a leadership key: the instance and the term (the key's create revision)."""

    instance: str
    term: int
    lease_id: int


@dataclass(frozen=True, slots=True)
class Campaign:
    """The answer to one campaign: won (at ``holder.term``) or someone else holds it."""

    won: bool
    holder: Holder


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


def _int(value: object, *, what: str) -> int:
    """etcd's int64 fields arrive as JSON strings (or are left out when zero)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        msg = f"etcd answered a non-integer {what}: {value!r:.80}"
        raise EtcdError(msg)
    try:
        number = int(value)
    except ValueError as exc:
        msg = f"etcd answered a non-integer {what}: {value!r:.80}"
        raise EtcdError(msg) from exc
    if not 0 <= number < 2**63:
        msg = f"etcd answered {what} {number} outside int64"
        raise EtcdError(msg)
    return number


def _dict(value: object, *, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        msg = f"etcd answered no object for {what}"
        raise EtcdError(msg)
    return value


def _holder(kv: object) -> Holder:
    kv = _dict(kv, what="a key")
    raw = kv.get("value", "")
    if not isinstance(raw, str) or len(raw) > MAX_VALUE_CHARS * 2:
        msg = "etcd answered a leadership value that is not short base64 text"
        raise EtcdError(msg)
    try:
        instance = base64.b64decode(raw, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        msg = "etcd answered a leadership value that is not base64 UTF-8"
        raise EtcdError(msg) from exc
    return Holder(
        instance=instance[:MAX_VALUE_CHARS],
        term=_int(kv.get("create_revision"), what="create_revision"),
        lease_id=_int(kv.get("lease"), what="lease"),
    )


class EtcdClient:
    """The five etcd v3 calls of an election, over the JSON gateway, endpoint by endpoint."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
    ) -> None:
        if not endpoints:
            msg = "no etcd endpoints"
            raise ValueError(msg)
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self._username, self._password = username, password
        self._ssl: ssl.SSLContext | None = None
        if ca_file is not None or cert_file is not None:
            self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            if cert_file is not None:
                self._ssl.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
        self._session: aiohttp.ClientSession | None = None
        self._preferred = 0
        self._token: str | None = None

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first endpoint that answers; the parsed, bounded JSON object."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        problems = []
        count = len(self.endpoints)
        for step in range(count):
            index = (self._preferred + step) % count
            url = self.endpoints[index] + path
            try:
                answer = await self._post_one(url, body)
            except EtcdError as exc:
                problems.append(f"{self.endpoints[index]}: {exc}")
                continue
            self._preferred = index
            return answer
        raise EtcdError("; ".join(problems)[:1000])

    async def _post_one(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None  # noqa: S101 - made by _post
        headers = {"Authorization": self._token} if self._token else {}
        try:
            async with self._session.post(
                url, json=body, ssl=self._ssl if self._ssl is not None else True, headers=headers
            ) as r:
                data = await r.content.read(MAX_RESPONSE_BYTES + 1)
                status = r.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            msg = f"{type(exc).__name__}: {exc}"
            raise EtcdError(msg) from exc
        if len(data) > MAX_RESPONSE_BYTES:
            msg = f"answer over {MAX_RESPONSE_BYTES} bytes"
            raise EtcdError(msg)
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError) as exc:
            msg = f"HTTP {status}, not JSON"
            raise EtcdError(msg) from exc
        answer = _dict(parsed, what=url)
        if status == 401 and self._username and not self._token:
            await self._authenticate(url.rsplit("/v3/", 1)[0])
            return await self._post_one(url, body)
        if status != 200:
            msg = f"HTTP {status}: {str(answer.get('message') or answer.get('error'))[:200]}"
            raise EtcdError(msg)
        return answer

    async def _authenticate(self, base: str) -> None:
        answer = await self._post_one(
            base + "/v3/auth/authenticate",
            {"name": self._username, "password": self._password or ""},
        )
        token = answer.get("token")
        if not isinstance(token, str) or not 0 < len(token) <= 4096:
            msg = "etcd authentication answered no token"
            raise EtcdError(msg)
        self._token = token

    async def grant(self, ttl_s: float) -> tuple[int, float]:
        """A new lease: its id and the ttl etcd granted (it may round up)."""
        answer = await self._post("/v3/lease/grant", {"TTL": str(max(1, round(ttl_s)))})
        lease_id = _int(answer.get("ID"), what="lease ID")
        if lease_id == 0:
            msg = f"etcd granted no lease: {str(answer.get('error'))[:200]}"
            raise EtcdError(msg)
        return lease_id, float(_int(answer.get("TTL"), what="TTL"))

    async def keepalive(self, lease_id: int) -> bool:
        """Renew a lease once; False when etcd no longer knows it (expired or revoked)."""
        answer = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)})
        result = _dict(answer.get("result", {}), what="keepalive result")
        return _int(result.get("TTL"), what="TTL") > 0

    async def revoke(self, lease_id: int) -> None:
        """End a lease now (a clean stop: the key goes at once, a standby leads sooner)."""
        await self._post("/v3/lease/revoke", {"ID": str(lease_id)})

    async def campaign(self, key: str, instance: str, lease_id: int) -> Campaign:
        """Create ``key`` = ``instance`` under the lease unless it exists; who holds it."""
        k = _b64(key)
        answer = await self._post(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                ],
                "success": [
                    {"request_put": {"key": k, "value": _b64(instance), "lease": str(lease_id)}}
                ],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        header = _dict(answer.get("header", {}), what="header")
        if answer.get("succeeded") is True:
            return Campaign(
                True, Holder(instance, _int(header.get("revision"), what="revision"), lease_id)
            )
        responses = answer.get("responses")
        if not isinstance(responses, list) or len(responses) != 1:
            msg = "etcd answered a transaction without one response"
            raise EtcdError(msg)
        found = _dict(_dict(responses[0], what="response").get("response_range"), what="range")
        kvs = found.get("kvs") or []
        if not isinstance(kvs, list) or len(kvs) > 1:
            msg = "etcd answered a range that is not one key"
            raise EtcdError(msg)
        if not kvs:  # deleted between the compare and the range: try again next time
            return Campaign(False, Holder("", 0, 0))
        return Campaign(False, _holder(kvs[0]))


@dataclass(slots=True)
class Elector:
    """One member's campaign for one shard: the loop body and its timing.

    ``on_change`` is called (on the event loop) whenever this member starts or stops
    leading, or sees another leader; the runtime publishes the audit event and wakes the
    control step there.
    """

    client: EtcdClient
    key: str
    instance: str
    leadership: Leadership
    ttl_s: float
    poll_s: float
    on_change: Callable[[], object]
    mono_ns: Callable[[], int] = time.monotonic_ns
    lease_id: int = 0
    failures: int = 0

    async def once(self) -> None:
        """One round: hold a lease, renew it, campaign when not leading. Never raises
        for etcd's sake: a failed round counts, and past the deadline leadership is lost."""
        log = structlog.get_logger().bind(shard_key=self.key, instance=self.instance)
        before = (self.leadership.role, self.leadership.leader, self.leadership.leader_term)
        sent = self.mono_ns()
        try:
            if self.lease_id == 0:
                self.lease_id, granted_s = await self.client.grant(self.ttl_s)
                self.ttl_s = max(self.ttl_s, granted_s)
            elif not await self.client.keepalive(self.lease_id):
                log.warning("etcd_lease_lost", lease=self.lease_id)
                self.lease_id = 0
                self.leadership.lost()
                return
            if self.leadership.role == "leader":
                self.leadership.renewed(sent_mono_ns=sent, ttl_s=self.ttl_s)
            else:
                result = await self.client.campaign(self.key, self.instance, self.lease_id)
                # Won now, or the key is ours from a round whose answer was lost: we lead.
                ours = result.holder.lease_id == self.lease_id and result.holder.term > 0
                if result.won or ours:
                    self.leadership.elected(
                        term=result.holder.term,
                        instance=self.instance,
                        sent_mono_ns=sent,
                        ttl_s=self.ttl_s,
                    )
                else:
                    self.leadership.observed(
                        leader=result.holder.instance or None, term=result.holder.term
                    )
            if self.failures:
                log.info("etcd_reachable", after_failures=self.failures)
            self.failures = 0
        except EtcdError as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 20 == 0:
                log.warning("etcd_unreachable", failures=self.failures, error=str(exc)[:300])
        finally:
            if self.leadership.role == "leader" and not self.leadership.may_publish(self.mono_ns()):
                log.warning("leadership_deadline_passed", term=self.leadership.term)
                self.leadership.lost()
            after = (self.leadership.role, self.leadership.leader, self.leadership.leader_term)
            if after != before:
                self.on_change()

    def interval_s(self) -> float:
        """The pause before the next round: renew at a quarter ttl, campaign at ``poll_s``;
        after a failed round, at once (a tenth of ``poll_s``: another member may answer)."""
        if self.failures:
            return min(self.poll_s, self.ttl_s / 4) / 10
        if self.leadership.role == "leader":
            return self.ttl_s / 4
        return min(self.poll_s, self.ttl_s / 4)

    async def run(self) -> None:
        """Rounds until cancelled."""
        while True:
            await self.once()
            await asyncio.sleep(self.interval_s())

    async def resign(self) -> None:
        """A clean stop: revoke the lease so a standby leads at its next round."""
        if self.lease_id:
            try:
                await self.client.revoke(self.lease_id)
            except EtcdError as exc:
                structlog.get_logger().warning("etcd_revoke_failed", error=str(exc)[:300])
            self.lease_id = 0
        self.leadership.lost()


def elector_for(
    ha: HaSettings,
    *,
    key: str,
    instance: str,
    leadership: Leadership,
    on_change: Callable[[], object],
    mono_ns: Callable[[], int],
) -> Elector | None:
    """The campaign for ``key`` when ``ha`` is enabled (built, not connected)."""
    if not ha.enabled:
        return None
    client = EtcdClient(
        ha.etcd_endpoints,
        timeout_s=ha.request_timeout_s,
        username=ha.username,
        password=ha.secret(),
        ca_file=ha.tls_ca_file,
        cert_file=ha.tls_cert_file,
        key_file=ha.tls_key_file,
    )
    return Elector(
        client=client,
        key=key,
        instance=instance,
        leadership=leadership,
        ttl_s=ha.lease_ttl_s,
        poll_s=ha.campaign_interval_s,
        on_change=on_change,
        mono_ns=mono_ns,
    )
