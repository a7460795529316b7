"""Where each GPU's priority class comes from (``assignment:`` of the agent's settings).

The sources themselves are ``sources.py``'s (MQTT, Kubernetes, a file); the agent's
settings (``agent/config.py``) hold these as ``assignment``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from polca.settings import Group

_CLASS = r"^[A-Za-z0-9_.:-]{1,128}$"
_NAMESPACE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class PriorityThreshold(Group):
    """Pods whose ``spec.priority`` is at least ``min_priority`` get ``class``."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True
    )

    min_priority: int = Field(ge=-(2**31), le=2**31 - 1, description="Lowest priority matched.")
    priority_class: str = Field(
        alias="class", pattern=_CLASS, description="The polca class these pods get."
    )


class KubernetesAssignment(Group):
    """The Kubernetes assignment source: pod-resources and the pods' metadata."""

    pod_resources_socket: Path = Field(
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        description="The kubelet's pod-resources socket (mounted read-only).",
    )
    refresh_s: float = Field(1.0, gt=0, le=3600, description="How often pod-resources is read.")
    resource_prefixes: tuple[str, ...] = Field(
        ("nvidia.com/",),
        max_length=16,
        description="Device plugin resources that are GPUs (nvidia.com/gpu, nvidia.com/mig-*).",
    )
    node_name: str | None = Field(
        None,
        max_length=253,
        description="This node's Kubernetes name (default: $NODE_NAME from the downward API).",
    )
    api_url: str | None = Field(
        None,
        max_length=256,
        description="The API server (default: in-cluster, from the service account).",
    )
    token_file: Path | None = Field(
        None, description="Bearer token file (default: the service account's)."
    )
    ca_file: Path | None = Field(
        None, description="API server CA (default: the service account's)."
    )
    allow_http: bool = Field(False, description="Accept a plain http:// api_url (tests only).")
    grace_s: float = Field(
        30.0,
        ge=0,
        le=86_400,
        description="How long the last map is kept while pod-resources or the API cannot be "
        "read; after it every GPU falls back to the class capped first.",
    )
    annotation: str = Field(
        "polca.io/class",
        max_length=253,
        description="The pod annotation naming a polca class (the first rule).",
    )
    priority_thresholds: tuple[PriorityThreshold, ...] = Field(
        (),
        max_length=32,
        description="spec.priority -> class, the second rule: the first threshold a pod's "
        "priority reaches, in the order given (list the highest first).",
    )
    namespaces: dict[Annotated[str, Field(pattern=_NAMESPACE)], str] = Field(
        default_factory=dict,
        max_length=1024,
        description="namespace -> class, the third rule.",
    )
    top_class_namespaces: tuple[str, ...] = Field(
        (),
        max_length=1024,
        description="The only namespaces whose pods may claim the policy's top class by "
        "annotation or priority; any other claim gets the next class.",
    )
    idle_class: str | None = Field(
        None,
        pattern=_CLASS,
        description="The class of a GPU no pod holds (default: the policy's default_class).",
    )


class AssignmentSettings(Group):
    """Where each GPU's priority class comes from."""

    source: Literal["mqtt", "kubernetes", "file"] = Field(
        "mqtt",
        description="mqtt: the retained assign message (polca assign, a scheduler); "
        "kubernetes: the pods holding the GPUs; file: a static YAML map.",
    )
    file: Path | None = Field(
        None, description="The YAML map of the file source (watched; see docs/kubernetes.md)."
    )
    kubernetes: KubernetesAssignment = Field(default_factory=KubernetesAssignment)

    @model_validator(mode="after")
    def _file_given(self) -> Self:
        if self.source == "file" and self.file is None:
            msg = "assignment.source file needs assignment.file"
            raise ValueError(msg)
        return self
