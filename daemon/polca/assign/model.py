"""The values every assignment source shares (pure): what runs on a GPU and its class.

A source (the MQTT ``assign`` message, the Kubernetes source, a file) ends in an
``AssignmentUpdate``: each GPU's class (keyed by GPU UUID, MIG device UUID mapped to its
parent, or index as a string, as the MQTT assignment is), where the class came from, and
what workload holds the GPU. The agent takes every source's update through one path.

- ``PodDevices``: one container's devices, from the kubelet's pod-resources API
  (``assign/podresources.py``);
- ``PodMeta``: what the Kubernetes API says of a pod (``assign/kubeapi.py``);
- ``Workload``: the namespace, pod and container holding a GPU (attribution).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["AssignmentUpdate", "Origin", "PodDevices", "PodMeta", "Workload"]

Origin = Literal[
    "mqtt", "file", "annotation", "priority", "namespace", "default", "idle", "fallback"
]
"""Why a GPU has its class: the MQTT assignment, the file source, a pod annotation
(``polca.io/class``), the pod's ``spec.priority``, a namespace rule, the policy's default
class for a pod matching no rule, the idle class (no pod holds the GPU), or the fail-safe
fallback (the source is unreachable beyond its grace)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """The Kubernetes workload (or batch job) that holds a GPU."""

    namespace: str
    pod: str
    container: str = ""


@dataclass(frozen=True, slots=True)
class PodDevices:
    """One container's devices of one resource, as the kubelet reports them."""

    namespace: str
    pod: str
    container: str
    resource: str
    """The resource name, e.g. ``nvidia.com/gpu`` or ``nvidia.com/mig-1g.10gb``."""
    device_ids: tuple[str, ...]
    """GPU UUIDs (``GPU-...``), MIG device UUIDs (``MIG-...``) or, with the device
    plugin's ``index`` strategy, indices."""


@dataclass(frozen=True, slots=True)
class PodMeta:
    """What the Kubernetes API says of one pod (bounded, strictly parsed)."""

    namespace: str
    name: str
    uid: str
    node_name: str
    phase: str
    priority: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AssignmentUpdate:
    """One source's answer: each GPU's class, where it came from, who holds the GPU."""

    source: str
    """``mqtt``, ``kubernetes`` or ``file``."""
    classes: Mapping[str, str]
    """GPU key (UUID or index as a string) -> class."""
    origins: Mapping[str, Origin] = field(default_factory=dict)
    workloads: Mapping[str, Workload] = field(default_factory=dict)
    healthy: bool = True
    """False while the source cannot be read (its last map, or the fallback, is in force)."""
    reason: str = ""
    """Why it is unhealthy, for the status and the log."""
