"""The assignment sources behind one shape, and the one place that picks the configured one.

An assignment source tells the agent which priority class each of its GPUs runs: it
``run()``s forever and hands every new map to ``on_update`` as an ``AssignmentUpdate``
(the same value whichever source made it), asking the agent for its GPUs (``gpus``: UUID
to index, as the kubelet names them) and the policy's classes (``classes``) when it
needs them. ``source_for`` builds the one ``assignment.source`` names:

- ``file``: ``filesource.watch_assignment`` on ``assignment.file`` (an operator's map);
- ``kubernetes``: ``kubernetes.KubernetesSource`` over the kubelet's pod-resources socket
  and the API's pods of this node;
- ``mqtt`` (the default): no task. Its updates are messages on the node's own ``assign``
  topic, which the agent's bus already subscribes, decoded by the core like every other
  message (``agent/core.py``), so it needs no connection of its own.

The Kubernetes modules (gRPC, the API client) are imported only when that source is
configured: an agent that does not use them never loads them.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from polca.assign.config import AssignmentSettings, KubernetesAssignment
from polca.assign.model import AssignmentUpdate
from polca.assign.rules import Classes

__all__ = ["AssignmentSource", "FileSource", "source_for", "task_for"]


class AssignmentSource(Protocol):
    """What every assignment source does: hand each new map on, forever."""

    async def run(
        self,
        on_update: Callable[[AssignmentUpdate], Any],
        *,
        gpus: Callable[[], Mapping[str, str]],
        classes: Callable[[], Classes],
    ) -> NoReturn:
        """Hand the first map and every change to ``on_update``, until cancelled."""
        ...


@dataclass(frozen=True, slots=True)
class FileSource:
    """``node``'s map from a YAML file, read at start and after every change."""

    path: Path
    node: str
    debounce_s: float

    async def run(
        self,
        on_update: Callable[[AssignmentUpdate], Any],
        *,
        gpus: Callable[[], Mapping[str, str]],
        classes: Callable[[], Classes],
    ) -> NoReturn:
        """The file names GPUs by index and classes by name itself: ``gpus`` and
        ``classes`` are not needed (the core checks the classes against the policy)."""
        from polca.assign.filesource import watch_assignment  # noqa: PLC0415

        await watch_assignment(self.path, self.node, on_update, debounce_s=self.debounce_s)


def source_for(
    settings: AssignmentSettings, *, node: str, debounce_s: float
) -> AssignmentSource | None:
    """The configured source for ``node``; None for ``mqtt`` (its updates are messages).

    ``debounce_s``: how long the file source waits for an edit to settle (the agent's
    ``policy_reload_debounce_s``, the same wait as for its policy file).
    """
    if settings.source == "kubernetes":
        return _kubernetes(settings.kubernetes)
    if settings.source == "file" and settings.file is not None:
        return FileSource(settings.file, node, debounce_s)
    return None


def task_for(
    settings: AssignmentSettings,
    *,
    node: str,
    debounce_s: float,
    on_update: Callable[[AssignmentUpdate], Any],
    gpus: Callable[[], Mapping[str, str]],
    classes: Callable[[], Classes],
) -> Coroutine[Any, Any, NoReturn] | None:
    """The agent's task for its configured source (None for ``mqtt``: no task).

    The source is built when the task starts, inside the agent's supervision, so a source
    that cannot be built (no node name for Kubernetes) ends the agent the way any failed
    loop does: through its shutdown, which leaves the GPUs at the fail-safe caps.
    """
    if settings.source == "mqtt":
        return None

    async def run() -> NoReturn:
        source = source_for(settings, node=node, debounce_s=debounce_s)
        if source is None:  # pragma: no cover - the settings model requires a file
            msg = f"assignment.source {settings.source} has nothing to read"
            raise AssertionError(msg)
        await source.run(on_update, gpus=gpus, classes=classes)

    return run()


def _kubernetes(k: KubernetesAssignment) -> AssignmentSource:
    """Pod-resources and the pods' metadata, joined every refresh."""
    from polca.assign.kubeapi import KubeApiConfig, PodWatcher  # noqa: PLC0415
    from polca.assign.kubernetes import KubernetesSource, node_name_of  # noqa: PLC0415
    from polca.assign.podresources import PodResourcesClient  # noqa: PLC0415

    in_cluster = k.api_url is None
    api = KubeApiConfig(
        in_cluster=in_cluster,
        api_url=k.api_url,
        token_file=None if in_cluster else k.token_file,
        ca_file=None if in_cluster else k.ca_file,
        allow_http=k.allow_http,
    )
    return KubernetesSource(
        k,
        devices=PodResourcesClient(k.pod_resources_socket, resource_prefixes=k.resource_prefixes),
        pods=PodWatcher(node_name_of(k), api),
    )
