"""Which class a pod's GPUs get, and the node's map from what runs where (pure).

The class rule, in order (``KubernetesAssignment`` settings):

1. the pod's annotation ``polca.io/class``, if it names a class the policy declares;
2. the pod's ``spec.priority`` against the configured thresholds (the first reached);
3. a namespace rule;
4. the policy's ``default_class``.

A GPU no pod holds gets the idle class (default: the policy's default class). Tenants are
not trusted: an annotation naming no declared class is ignored (the next rule decides),
and only the namespaces the operator lists (``top_class_namespaces``) may claim the
policy's top class by annotation or priority; any other claim gets the next class. A
namespace rule is the operator's own and is taken as written (if it names a declared
class).

``node_update`` turns the kubelet's devices (``PodDevices``) and the pods' metadata
(``PodMeta``) into the node's ``AssignmentUpdate``, keyed by GPU UUID: a MIG device's
class goes to its parent GPU, and a parent's class is the highest among its instances
(the first in the policy's order); ``Workload`` attribution likewise (the instance with
the highest class wins; ties: the first by name). Device ids the node does not know are
counted and left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from polca.assign.config import KubernetesAssignment
from polca.assign.model import AssignmentUpdate, Origin, PodDevices, PodMeta, Workload
from polca.gpu.backend import GpuInfo

__all__ = ["Classes", "NodeMap", "Rules", "fallback", "gpu_keys", "node_update", "pod_class"]


@dataclass(frozen=True, slots=True)
class Classes:
    """The policy's classes, most important first, and its default."""

    order: tuple[str, ...]
    default: str

    @property
    def top(self) -> str:
        """The most important class."""
        return self.order[0]

    @property
    def capped_first(self) -> str:
        """The least important class: the one the ladder caps first (the fallback)."""
        return self.order[-1]

    def rank(self, cls: str) -> int:
        """Lower is more important; unknown classes rank last."""
        return self.order.index(cls) if cls in self.order else len(self.order)


@dataclass(frozen=True, slots=True)
class Rules:
    """The class rule of the Kubernetes source, checked against the policy's classes."""

    settings: KubernetesAssignment
    classes: Classes

    def idle(self) -> str:
        """The class of a GPU no pod holds."""
        idle = self.settings.idle_class
        return idle if idle is not None and idle in self.classes.order else self.classes.default


def _allowed(cls: str, pod: PodMeta, rules: Rules) -> str:
    """``cls`` unless it is the top class and the pod's namespace may not claim it."""
    classes = rules.classes
    if cls != classes.top or pod.namespace in rules.settings.top_class_namespaces:
        return cls
    return classes.order[1] if len(classes.order) > 1 else cls


def pod_class(pod: PodMeta, rules: Rules) -> tuple[str, Origin]:
    """A pod's class and the rule that gave it."""
    settings, declared = rules.settings, rules.classes.order
    claimed = pod.annotations.get(settings.annotation)
    if claimed is not None and claimed in declared:
        return _allowed(claimed, pod, rules), "annotation"
    if pod.priority is not None:
        for threshold in settings.priority_thresholds:
            if pod.priority >= threshold.min_priority and threshold.priority_class in declared:
                return _allowed(threshold.priority_class, pod, rules), "priority"
    by_namespace = settings.namespaces.get(pod.namespace)
    if by_namespace is not None and by_namespace in declared:
        return by_namespace, "namespace"
    return rules.classes.default, "default"


@dataclass(slots=True)
class _Held:
    cls: str
    origin: Origin
    workload: Workload


@dataclass(frozen=True, slots=True)
class NodeMap:
    """The node's update, and what could not be placed."""

    update: AssignmentUpdate
    unknown_devices: tuple[str, ...] = field(default=())
    """Device ids naming no GPU or MIG device of this node."""
    unknown_pods: tuple[str, ...] = field(default=())
    """``namespace/pod`` holding a GPU with no metadata (yet): the default class."""


def node_update(
    devices: Sequence[PodDevices],
    pods: Mapping[str, PodMeta],
    *,
    gpus: Mapping[str, str],
    rules: Rules,
) -> NodeMap:
    """The node's map from the kubelet's devices and the pods' metadata.

    ``gpus`` maps every id the device plugin may report (GPU UUIDs, MIG device UUIDs,
    indices as strings) to the GPU's key in the map (its UUID); ``pods`` is by uid.
    """
    by_name = {(p.namespace, p.name): p for p in pods.values()}
    held: dict[str, _Held] = {}
    unknown_devices: list[str] = []
    unknown_pods: list[str] = []
    for group in devices:
        pod = by_name.get((group.namespace, group.pod))
        cls: str
        origin: Origin
        if pod is None:
            cls, origin = rules.classes.default, "default"
            unknown_pods.append(f"{group.namespace}/{group.pod}")
        else:
            cls, origin = pod_class(pod, rules)
        workload = Workload(group.namespace, group.pod, group.container)
        for device in group.device_ids:
            key = gpus.get(device)
            if key is None:
                unknown_devices.append(device)
                continue
            now = held.get(key)
            if now is None or _better(cls, workload, now, rules.classes):
                held[key] = _Held(cls, origin, workload)
    classes: dict[str, str] = {}
    origins: dict[str, Origin] = {}
    workloads: dict[str, Workload] = {}
    idle = rules.idle()
    for key in dict.fromkeys(gpus.values()):
        entry = held.get(key)
        if entry is None:
            classes[key], origins[key] = idle, "idle"
        else:
            classes[key], origins[key] = entry.cls, entry.origin
            workloads[key] = entry.workload
    update = AssignmentUpdate(
        source="kubernetes", classes=classes, origins=origins, workloads=workloads
    )
    return NodeMap(
        update,
        unknown_devices=tuple(sorted(set(unknown_devices))),
        unknown_pods=tuple(sorted(set(unknown_pods))),
    )


def _better(cls: str, workload: Workload, now: _Held, classes: Classes) -> bool:
    """Whether ``cls`` (held by ``workload``) wins over what a GPU holds already."""
    rank, current = classes.rank(cls), classes.rank(now.cls)
    if rank != current:
        return rank < current
    return (workload.namespace, workload.pod, workload.container) < (
        now.workload.namespace,
        now.workload.pod,
        now.workload.container,
    )


def gpu_keys(infos: Iterable[GpuInfo]) -> dict[str, str]:
    """Every id a device plugin may report for this node's GPUs -> the GPU's key (its
    UUID): the UUID, the index as a string, and each MIG device's UUID (its parent)."""
    keys: dict[str, str] = {}
    for info in infos:
        keys[info.uuid] = info.uuid
        keys[str(info.index)] = info.uuid
        for device in info.mig_devices:
            keys[device.uuid] = info.uuid
    return keys


def fallback(gpus: Mapping[str, str], classes: Classes, *, reason: str) -> AssignmentUpdate:
    """Every GPU at the class capped first: the source has been unreadable too long."""
    keys = dict.fromkeys(gpus.values())
    return AssignmentUpdate(
        source="kubernetes",
        classes=dict.fromkeys(keys, classes.capped_first),
        origins=dict.fromkeys(keys, "fallback"),
        healthy=False,
        reason=reason,
    )
