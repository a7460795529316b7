"""The class rule and the node's map (pure): annotation, priority, namespace, default,
idle; untrusted tenants; MIG instances folded onto their parent; the fail-safe fallback."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.assign.config import KubernetesAssignment
from polca.assign.kubernetes import Freshness
from polca.assign.model import PodDevices, PodMeta, Workload
from polca.assign.rules import Classes, Rules, fallback, node_update, pod_class

CLASSES = Classes(("critical", "high", "low"), default="low")
SETTINGS = KubernetesAssignment.model_validate(
    {
        "priority_thresholds": [
            {"min_priority": 1_000_000, "class": "critical"},
            {"min_priority": 1_000, "class": "high"},
        ],
        "namespaces": {"batch": "low", "serving": "high"},
        "top_class_namespaces": ["serving"],
        "idle_class": "low",
    }
)
RULES = Rules(SETTINGS, CLASSES)
GPUS = {
    "GPU-a": "GPU-a",
    "GPU-b": "GPU-b",
    "0": "GPU-a",
    "1": "GPU-b",
    "MIG-a1": "GPU-a",
    "MIG-a2": "GPU-a",
}


def pod(name: str, namespace: str = "serving", **fields: Any) -> PodMeta:
    return PodMeta(
        namespace=namespace,
        name=name,
        uid=f"uid-{namespace}-{name}",
        node_name="node1",
        phase="Running",
        **fields,
    )


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        (pod("p", annotations={"polca.io/class": "high"}), ("high", "annotation")),
        (pod("p", annotations={"polca.io/class": "critical"}), ("critical", "annotation")),
        # A tenant outside the listed namespaces cannot claim the top class: the next one.
        (pod("p", "team-x", annotations={"polca.io/class": "critical"}), ("high", "annotation")),
        (pod("p", "team-x", priority=2_000_000), ("high", "priority")),
        # An annotation naming no declared class is ignored: the next rule decides.
        (pod("p", "batch", annotations={"polca.io/class": "platinum"}), ("low", "namespace")),
        (pod("p", priority=5_000), ("high", "priority")),
        (pod("p", "batch", priority=10), ("low", "namespace")),
        (pod("p", "team-x"), ("low", "default")),
    ],
)
def test_the_class_rule_in_order(meta: PodMeta, expected: tuple[str, str]) -> None:
    assert pod_class(meta, RULES) == expected


def test_the_node_map_folds_instances_onto_their_parent_and_idles_the_rest() -> None:
    """Two MIG instances of GPU-a held by pods of two classes: the parent takes the
    higher; GPU-b held by nobody is idle; unknown device ids are counted, not used."""
    devices = [
        PodDevices("batch", "train", "main", "nvidia.com/mig-1g.10gb", ("MIG-a1",)),
        PodDevices("serving", "llm", "server", "nvidia.com/mig-3g.40gb", ("MIG-a2",)),
        PodDevices("batch", "ghost", "main", "nvidia.com/gpu", ("GPU-zzz",)),
    ]
    pods = {
        p.uid: p
        for p in (pod("train", "batch"), pod("llm", annotations={"polca.io/class": "high"}))
    }
    mapped = node_update(devices, pods, gpus=GPUS, rules=RULES)
    u = mapped.update
    assert u.classes == {"GPU-a": "high", "GPU-b": "low"}
    assert u.origins == {"GPU-a": "annotation", "GPU-b": "idle"}
    assert u.workloads == {"GPU-a": Workload("serving", "llm", "server")}
    assert mapped.unknown_devices == ("GPU-zzz",)
    assert mapped.unknown_pods == ("batch/ghost",)


def test_a_pod_without_metadata_yet_gets_the_default_class() -> None:
    devices = [PodDevices("serving", "new", "c", "nvidia.com/gpu", ("1",))]  # index strategy
    mapped = node_update(devices, {}, gpus=GPUS, rules=RULES)
    assert mapped.update.classes["GPU-b"] == "low"
    assert mapped.update.origins["GPU-b"] == "default"
    assert mapped.unknown_pods == ("serving/new",)


def test_the_fallback_puts_every_gpu_in_the_class_capped_first() -> None:
    u = fallback(GPUS, CLASSES, reason="pod-resources unreadable for 31 s")
    assert u.classes == {"GPU-a": "low", "GPU-b": "low"}
    assert set(u.origins.values()) == {"fallback"}
    assert not u.healthy
    assert "31 s" in u.reason


def test_freshness_holds_the_map_for_the_grace_then_falls_back() -> None:
    fresh = Freshness(grace_s=30.0, started_s=100.0)
    assert fresh.stale(120.0) is None  # before the first read: the grace from the start
    assert fresh.stale(131.0) == "pod-resources unreadable for more than 30 s (never read)"
    assert fresh.stale(140.0) == fresh.stale(131.0)  # one reason for the whole outage
    fresh.devices.ok(131.0)
    fresh.pods.ok(131.0)
    assert fresh.stale(160.0) is None
    fresh.pods.ok(165.0)
    assert (fresh.stale(162.0)) is not None  # pod-resources last read at 131
    assert "pod-resources" in (fresh.stale(162.0) or "")


names = st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True)


@given(
    st.lists(
        st.tuples(
            names,
            names,
            st.none() | st.integers(-(2**31), 2**31 - 1),
            st.dictionaries(
                st.sampled_from(["polca.io/class", "other"]), st.text(max_size=12), max_size=2
            ),
            st.lists(st.sampled_from([*sorted(GPUS), "GPU-x", "7"]), max_size=4),
        ),
        max_size=20,
    )
)
def test_every_map_names_declared_classes_and_no_unlisted_tenant_gets_the_top(
    entries: list[tuple[str, str, int | None, dict[str, str], list[str]]],
) -> None:
    pods: dict[str, PodMeta] = {}
    devices = []
    for namespace, name, priority, notes, ids in entries:
        meta = pod(name, namespace, priority=priority, annotations=notes)
        pods[meta.uid] = meta
        devices.append(PodDevices(namespace, name, "c", "nvidia.com/gpu", tuple(ids)))
    u = node_update(devices, pods, gpus=GPUS, rules=RULES).update
    assert set(u.classes) == {"GPU-a", "GPU-b"}
    assert set(u.classes.values()) <= set(CLASSES.order)
    for key, cls in u.classes.items():
        if cls == "critical":
            workload = u.workloads[key]
            assert workload.namespace in SETTINGS.top_class_namespaces
