"""The Kubernetes API pod watcher, through lightkube, against the API stand-in process.

Every test talks HTTP on loopback to ``tests/standins/kubeapi.py`` (a real server process
speaking the API's JSON: pod lists, watches, 410 Gone, bearer tokens) through the real
lightkube client; ``parse_pod``'s bounds are also checked one by one, as a pure function.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import ValidationError

from polca.assign.kubeapi import KubeApiConfig, PodWatcher, parse_pod
from polca.errors import IdentityError, OversizedError, SchemaError
from tests.services import free_port, started
from tests.standins.fixtures import TlsFiles, tls_files
from tests.standins.kubeapi_process import KubeApiStandIn, make_pod

NODE = "gpu-node-1"
OTHER = "gpu-node-2"
TOKEN = "polca-test-token"  # noqa: S105 - the stand-in's, on loopback
WRONG_TOKEN = "not-the-token"  # noqa: S105

__all__ = ["tls_files"]  # the fixture, from the Redfish stand-in's


@pytest.fixture
def kubeapi(tmp_path: Path) -> Iterator[KubeApiStandIn]:
    """A stand-in holding one pod on our node and one on another."""
    pods = [
        make_pod("train", "llm-0", node=NODE, labels={"app": "llm"}, priority=1000),
        make_pod("train", "llm-1", node=OTHER, labels={"app": "llm"}),
    ]
    yield from started(KubeApiStandIn(tmp_path / "kubeapi", token=TOKEN, pods=pods))


def config_for(url: str, tmp_path: Path, *, token: str = TOKEN, **extra: Any) -> KubeApiConfig:
    """A plain-HTTP configuration with fast retries, the token in a file."""
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n", encoding="utf-8")
    settings: dict[str, Any] = {
        "in_cluster": False,
        "api_url": url,
        "token_file": token_file,
        "allow_http": True,
        "timeout_s": 5.0,
        "backoff_min_s": 0.05,
        "backoff_max_s": 0.4,
    }
    return KubeApiConfig(**(settings | extra))


@asynccontextmanager
async def running(watcher: PodWatcher) -> AsyncIterator[asyncio.Task[Any]]:
    """``watcher.run()`` as a task for the block; cancelled (and awaited) after it."""
    task = asyncio.create_task(watcher.run(), name="pod-watcher")
    try:
        yield task
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def until(what: str, check: Callable[[], bool], *, within_s: float = 1.0) -> float:
    """Wait until ``check()`` holds (at most ``within_s``); the seconds it took."""
    started_at = time.monotonic()
    while not check():
        if time.monotonic() - started_at > within_s:
            pytest.fail(f"not within {within_s} s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started_at


def names(watcher: PodWatcher) -> set[str]:
    """``namespace/name`` of the pods the watcher holds."""
    return {f"{pod.namespace}/{pod.name}" for pod in watcher.pods().values()}


async def test_lists_then_follows_scheduled_modified_and_deleted_pods(
    kubeapi: KubeApiStandIn, tmp_path: Path
) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
    assert not watcher.healthy
    assert watcher.last_ok_s is None
    async with running(watcher):
        await until("the first list", lambda: watcher.healthy, within_s=5.0)
        assert names(watcher) == {"train/llm-0"}, "only this node's pods"
        (first,) = watcher.pods().values()
        assert (first.node_name, first.phase, first.priority) == (NODE, "Running", 1000)
        assert first.labels == {"app": "llm"}
        assert first.annotations == {}
        assert watcher.error is None
        assert watcher.last_ok_s is not None

        uid = kubeapi.put_pod("infer", "chat-0", node=NODE, priority=-5, phase="Pending")
        await until("a scheduled pod", lambda: uid in watcher.pods())
        kubeapi.put_pod("infer", "chat-0", node=NODE, annotations={"polca.io/class": "latency"})
        await until(
            "a re-annotated pod (MODIFIED)",
            lambda: watcher.pods()[uid].annotations == {"polca.io/class": "latency"},
        )
        assert watcher.pods()[uid].priority is None, "the replaced spec has none"
        kubeapi.put_pod("infer", "elsewhere", node=OTHER)
        kubeapi.delete_pod("infer", "chat-0")
        await until("a deleted pod", lambda: uid not in watcher.pods())
        assert names(watcher) == {"train/llm-0"}, "another node's pod never shows"
        assert watcher.lists == 1, "events, not re-lists"
        assert watcher.watch_events == 3
        assert watcher.dropped.total() == 0


async def test_outage_keeps_the_last_pods_then_recovers_with_a_relist(
    kubeapi: KubeApiStandIn, tmp_path: Path
) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
    with structlog.testing.capture_logs() as logs:
        async with running(watcher):
            await until("the first list", lambda: watcher.healthy, within_s=5.0)
            kubeapi.fault("outage")  # open watches cut, then 503
            await until("the outage seen", lambda: not watcher.healthy, within_s=2.0)
            assert watcher.error is not None
            assert "503" in watcher.error
            assert names(watcher) == {"train/llm-0"}, "the last pods are kept"
            await until("retries", lambda: watcher.list_failures >= 3, within_s=3.0)
            kubeapi.put_pod("infer", "during-outage", node=NODE)
            kubeapi.fault("none")
            await until("recovery", lambda: watcher.healthy, within_s=2.0)
            assert watcher.error is None
            assert names(watcher) == {"train/llm-0", "infer/during-outage"}, "re-listed"
            assert watcher.lists >= 2
            assert watcher.watch_ends["error"] >= 1
    events = [entry["event"] for entry in logs]
    assert events.count("kube_api_unreachable") == 1, "one line per outage, not per retry"
    assert events.count("kube_api_recovered") == 1


async def test_outage_that_ends_the_watch_cleanly_is_seen_too(
    kubeapi: KubeApiStandIn, tmp_path: Path
) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
    async with running(watcher):
        await until("the first list", lambda: watcher.healthy, within_s=5.0)
        kubeapi.fault("outage", close="eof")
        await until("the outage seen", lambda: not watcher.healthy, within_s=2.0)
        assert watcher.watch_ends["closed"] >= 1
        assert names(watcher) == {"train/llm-0"}
        kubeapi.fault("none")
        await until("recovery", lambda: watcher.healthy, within_s=2.0)


async def test_gone_relists_without_losing_pods(kubeapi: KubeApiStandIn, tmp_path: Path) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
    async with running(watcher):
        await until("the first list", lambda: watcher.healthy, within_s=5.0)
        before = watcher.pods()
        lost: list[set[str]] = []

        def relisted() -> bool:
            if watcher.pods().keys() != before.keys():
                lost.append(set(before) - set(watcher.pods()))
            return watcher.lists >= 2

        kubeapi.fault("gone")  # the open watch gets the 410 ERROR event
        await until("a re-list after 410", relisted)
        assert watcher.watch_ends["gone"] == 1
        assert not lost, "no pod missing at any moment"
        assert watcher.healthy
        uid = kubeapi.put_pod("infer", "after-gone", node=NODE)
        await until("the new watch follows", lambda: uid in watcher.pods())
    assert kubeapi.stats()["watches"] >= 2


async def test_hostile_pods_are_dropped_and_counted_the_others_kept(
    kubeapi: KubeApiStandIn, tmp_path: Path
) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
    expected = {"oversized": 2, "identity": 1, "malformed": 3}
    async with running(watcher):
        await until("the first list", lambda: watcher.healthy, within_s=5.0)
        kubeapi.fault("hostile", node=NODE)
        uid = kubeapi.put_pod("infer", "after-hostile", node=NODE)
        await until("the pod after them", lambda: uid in watcher.pods())
        assert dict(watcher.dropped) == expected, "through the watch"
        assert names(watcher) == {"train/llm-0", "infer/after-hostile"}
        kubeapi.fault("gone")  # a re-list: the list holds the hostile pods now
        await until("a re-list", lambda: watcher.lists >= 2)
        assert dict(watcher.dropped) == {k: 2 * n for k, n in expected.items()}, "through a list"
        assert names(watcher) == {"train/llm-0", "infer/after-hostile"}
        assert watcher.healthy


async def test_a_pod_turned_hostile_is_forgotten(kubeapi: KubeApiStandIn, tmp_path: Path) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
    async with running(watcher):
        await until("the first list", lambda: watcher.healthy, within_s=5.0)
        uid = kubeapi.put_pod("infer", "turns", node=NODE)
        await until("the pod", lambda: uid in watcher.pods())
        kubeapi.put_pod("infer", "turns", node=NODE, annotations={"a": "x" * 5000})
        await until("forgotten", lambda: uid not in watcher.pods())
        assert watcher.dropped["oversized"] == 1


async def test_a_watch_event_over_the_bound_ends_the_watch_not_the_source(
    kubeapi: KubeApiStandIn, tmp_path: Path
) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
    async with running(watcher):
        await until("the first list", lambda: watcher.healthy, within_s=5.0)
        kubeapi.put_pod("infer", "vast", node=NODE, annotations={"a": "x" * (5 * 1024 * 1024)})
        await until("a re-list", lambda: watcher.lists >= 2, within_s=3.0)
        assert watcher.watch_ends["error"] == 1
        assert "OversizedError: a watch event over" in str(watcher.watch_error)
        assert watcher.dropped == {"oversized": 1}, "the list (not bounded per pod) refused it"
        assert names(watcher) == {"train/llm-0"}
        assert watcher.healthy


async def test_2000_pods_on_the_node_are_bounded_to_max_pods(tmp_path: Path) -> None:
    pods = [make_pod(f"ns-{i % 20}", f"pod-{i}", node=NODE) for i in range(2000)]
    pods.append(make_pod("elsewhere", "pod", node=OTHER))
    with KubeApiStandInRunning(tmp_path, pods) as kubeapi:
        watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
        async with running(watcher):
            await until("the first list", lambda: watcher.healthy, within_s=10.0)
            assert len(watcher.pods()) == 1024
            assert watcher.dropped == {"capacity": 2000 - 1024}
            uid = kubeapi.put_pod("infer", "one-more", node=NODE)
            await until("a watch event", lambda: watcher.watch_events >= 1)
            assert uid not in watcher.pods(), "refused: no room"
            assert watcher.dropped["capacity"] == 2000 - 1024 + 1
            kubeapi.delete_pod("ns-0", "pod-0")
            kubeapi.delete_pod("ns-1", "pod-1")
            kubeapi.put_pod("infer", "one-more", node=NODE)
            await until("room again", lambda: uid in watcher.pods())
            assert len(watcher.pods()) <= 1024


async def test_a_list_over_max_response_bytes_is_refused(tmp_path: Path) -> None:
    pods = [make_pod("train", f"pod-{i}", node=NODE) for i in range(300)]
    with KubeApiStandInRunning(tmp_path, pods) as kubeapi:
        config = config_for(kubeapi.url, tmp_path, max_response_bytes=64 * 1024)
        watcher = PodWatcher(NODE, config)
        async with running(watcher):
            await until("the refusal", lambda: watcher.error is not None, within_s=5.0)
            assert not watcher.healthy
            assert "OversizedError" in str(watcher.error)
            assert watcher.pods() == {}


async def test_a_wrong_token_is_unhealthy_with_a_clear_error(
    kubeapi: KubeApiStandIn, tmp_path: Path
) -> None:
    watcher = PodWatcher(NODE, config_for(kubeapi.url, tmp_path, token=WRONG_TOKEN))
    async with running(watcher) as task:
        await until("the refusal", lambda: watcher.error is not None, within_s=5.0)
        assert not watcher.healthy
        assert watcher.error is not None
        assert watcher.error.startswith("HTTP 401 Unauthorized"), watcher.error
        assert "token" in watcher.error
        await until("retries", lambda: watcher.list_failures >= 2, within_s=3.0)
        assert not task.done(), "a refusal is not a crash"
        assert watcher.pods() == {}


async def test_no_server_is_unhealthy_and_retried(tmp_path: Path) -> None:
    config = config_for(f"http://127.0.0.1:{free_port()}", tmp_path)
    watcher = PodWatcher(NODE, config)
    async with running(watcher):
        await until("the failure", lambda: watcher.list_failures >= 2, within_s=5.0)
        assert not watcher.healthy
        assert "ConnectError" in str(watcher.error)


async def test_in_cluster_without_a_pod_environment_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    config = KubeApiConfig(service_account_dir=tmp_path, backoff_min_s=0.05, backoff_max_s=0.1)
    watcher = PodWatcher(NODE, config)
    async with running(watcher):
        await until("the failure", lambda: watcher.error is not None)
        assert "KUBERNETES_SERVICE_HOST" in str(watcher.error)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
        await until("the next failure", lambda: "token" in str(watcher.error))
        assert str(tmp_path / "token") in str(watcher.error)


async def test_https_verifies_the_server_with_the_ca_file(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    pods = [make_pod("train", "llm-0", node=NODE)]
    tls = (tls_files.cert, tls_files.key)
    with KubeApiStandInRunning(tmp_path, pods, tls=tls) as kubeapi:
        assert kubeapi.url.startswith("https://")
        trusting = PodWatcher(NODE, config_for(kubeapi.url, tmp_path, ca_file=tls_files.ca))
        async with running(trusting):
            await until("the list over TLS", lambda: trusting.healthy, within_s=5.0)
            assert names(trusting) == {"train/llm-0"}
        unknown_ca = PodWatcher(NODE, config_for(kubeapi.url, tmp_path))
        async with running(unknown_ca):
            await until("the refusal", lambda: unknown_ca.error is not None, within_s=5.0)
            assert "CERTIFICATE_VERIFY_FAILED" in str(unknown_ca.error)
            assert unknown_ca.pods() == {}


async def test_in_cluster_reads_the_service_account_and_environment(
    tmp_path: Path, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = [make_pod("train", "llm-0", node=NODE)]
    tls = (tls_files.cert, tls_files.key)
    with KubeApiStandInRunning(tmp_path, pods, tls=tls) as kubeapi:
        account = tmp_path / "serviceaccount"
        account.mkdir()
        (account / "token").write_text(TOKEN, encoding="utf-8")
        (account / "ca.crt").write_bytes(tls_files.ca.read_bytes())
        (account / "namespace").write_text("polca", encoding="utf-8")
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kubeapi.port))
        config = KubeApiConfig(service_account_dir=account, backoff_min_s=0.05)
        watcher = PodWatcher(NODE, config)
        async with running(watcher):
            await until("the in-cluster list", lambda: watcher.healthy, within_s=5.0)
            assert names(watcher) == {"train/llm-0"}


class KubeApiStandInRunning:
    """A stand-in started with ``pods`` for a ``with`` block, then killed."""

    def __init__(
        self,
        tmp_path: Path,
        pods: list[dict[str, Any]],
        *,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.process = KubeApiStandIn(tmp_path / "kubeapi", token=TOKEN, pods=pods, tls=tls)

    def __enter__(self) -> KubeApiStandIn:
        self.process.start()
        return self.process

    def __exit__(self, *_exc: object) -> None:
        self.process.kill()


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"api_url": "https://10.0.0.1:6443"}, "in_cluster: false"),
        ({"in_cluster": False}, "needs api_url"),
        ({"in_cluster": False, "api_url": "http://10.0.0.1:8080"}, "allow_http"),
        ({"in_cluster": False, "api_url": "ftp://10.0.0.1"}, "pattern"),
        ({"max_pods": 0}, "greater than or equal"),
        ({"backoff_min_s": 5, "backoff_max_s": 1}, "backoff_max_s"),
        ({"resync": 5}, "Extra inputs"),
    ],
)
def test_config_refuses(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KubeApiConfig(**settings)


def test_config_defaults_are_in_cluster() -> None:
    config = KubeApiConfig()
    assert config.in_cluster
    assert (config.max_pods, config.resync_s) == (1024, 300.0)


def test_a_node_name_must_be_a_dns_name() -> None:
    with pytest.raises(ValueError, match="DNS-1123"):
        PodWatcher("Not A Node", KubeApiConfig())


# --------------------------------------------------------------------------- parse_pod


def raw(**changes: Any) -> dict[str, Any]:
    """A well-formed pod as the API sends it, with ``metadata``/``spec`` fields changed."""
    pod = make_pod("train", "llm-0", node=NODE, uid="0b6e9c1e-2f5d-4a55-9d0f-4c1f0e7c5a11")
    for key, value in changes.items():
        section, name = key.split("__")
        pod[section][name] = value
    return pod


def test_parse_pod_reads_a_well_formed_pod() -> None:
    labels = {f"example.com/k{i}": "v" * 63 for i in range(64)}
    annotations = {"polca.io/class": "x" * 4096}
    pod = parse_pod(
        raw(metadata__labels=labels, metadata__annotations=annotations, spec__priority=2**31 - 1),
        NODE,
    )
    assert (pod.namespace, pod.name, pod.node_name) == ("train", "llm-0", NODE)
    assert pod.priority == 2**31 - 1
    assert pod.labels == labels
    assert pod.annotations == annotations
    assert parse_pod(raw(status__phase="Pending"), NODE).phase == "Pending"
    no_status = raw()
    del no_status["status"]
    assert parse_pod(no_status, NODE).phase == "Unknown"
    assert parse_pod(raw(spec__priority=-(2**31)), NODE).priority == -(2**31)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"spec__nodeName": OTHER}, IdentityError),
        ({"spec__nodeName": None}, IdentityError),
        ({"metadata__namespace": "Train"}, SchemaError),
        ({"metadata__namespace": "a" * 64}, SchemaError),
        ({"metadata__name": "a" * 254}, SchemaError),
        ({"metadata__name": "llm_0"}, SchemaError),
        ({"metadata__uid": "u" * 65}, SchemaError),
        ({"metadata__uid": 7}, SchemaError),
        ({"spec__priority": 2**31}, SchemaError),
        ({"spec__priority": True}, SchemaError),
        ({"spec__priority": 1.5}, SchemaError),
        ({"status__phase": "Sleeping"}, SchemaError),
        ({"metadata__labels": {f"k{i}": "v" for i in range(65)}}, OversizedError),
        ({"metadata__labels": {"k": "v" * 64}}, OversizedError),
        ({"metadata__labels": {"a" * 318: "v"}}, OversizedError),
        ({"metadata__labels": {"k": "not a value"}}, SchemaError),
        ({"metadata__labels": {"-k": "v"}}, SchemaError),
        ({"metadata__labels": {"Bad_Prefix/k": "v"}}, SchemaError),
        ({"metadata__labels": ["k"]}, SchemaError),
        ({"metadata__annotations": {"a": 1}}, SchemaError),
        ({"metadata__annotations": {"a": "x" * 4097}}, OversizedError),
        ({"metadata__annotations": {f"k{i}": "" for i in range(65)}}, OversizedError),
    ],
)
def test_parse_pod_refuses(changes: dict[str, Any], error: type[SchemaError]) -> None:
    with pytest.raises(SchemaError) as caught:
        parse_pod(raw(**changes), NODE)
    assert type(caught.value) is error
    assert caught.value.reason == error.reason


@pytest.mark.parametrize("obj", [None, 7, "pod", [], {"metadata": "x"}, {"metadata": {}}])
def test_parse_pod_refuses_what_is_not_a_pod(obj: object) -> None:
    with pytest.raises(SchemaError):
        parse_pod(obj, NODE)
