"""The node agent's settings: where the node sits (``topics:``), its GPUs (``gpu:``), its
control loop (``agent:``) and where its priority classes come from (``assignment:``),
with what every process reads (``mqtt``, ``logging``, ``metrics``:
``settings.ProcessSettings``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from polca.assign.config import AssignmentSettings
from polca.gpu.config import GpuSettings
from polca.settings import (
    DEFAULT_TOPIC_ROOT,
    TOPIC_SEGMENT,
    Group,
    ProcessSettings,
    SiteName,
    TopicRoot,
    load_settings_as,
)


class TopicSettings(Group):
    """Where this node sits in the site: the segments of its MQTT topics."""

    root: TopicRoot = DEFAULT_TOPIC_ROOT
    site: SiteName = "site"
    row: str = Field("row1", pattern=TOPIC_SEGMENT, description="Row (power domain) name.")
    rack: str = Field("rack1", pattern=TOPIC_SEGMENT, description="Rack name.")
    node: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0] or "node",
        description="Node name; defaults to the short host name.",
    )

    @field_validator("node")
    @classmethod
    def _node_segment(cls, value: str) -> str:
        cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in value)
        if not cleaned:
            msg = "node name must not be empty"
            raise ValueError(msg)
        return cleaned


class AgentSettings(Group):
    """The node agent's control loop."""

    sample_interval_s: float = Field(0.1, gt=0, description="GPU sampling period (10 Hz).")
    publish_interval_s: float = Field(
        1.0, gt=0, description="Telemetry period: one message per node per interval."
    )
    health_every_s: float = Field(
        30.0,
        ge=1,
        le=3600,
        description="GPU health counters are read every telemetry interval and sent when "
        "they change, and at least this often.",
    )
    policy_file: Path = Field(
        Path("/etc/polca/policy.yaml"), description="Node policy file (hot reloaded)."
    )
    policy_reload_debounce_s: float = Field(
        0.5, ge=0, description="Wait this long after a file change before reloading."
    )
    state_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("STATE_DIRECTORY", "/var/lib/polca")),
        description="Where the original GPU settings are saved before the first write "
        "(systemd's $STATE_DIRECTORY when set).",
    )
    observe_only: bool = Field(
        False, description="Read and publish, never write to the GPUs (no privilege needed)."
    )
    startup_grace_s: float = Field(
        30.0,
        ge=0,
        description="How long the agent waits for its first control message before the "
        "policy's fail-safe caps apply.",
    )
    stop_timeout_s: float = Field(
        5.0, gt=0, description="Bound on restoring GPU settings at shutdown."
    )
    control_silence_failover_s: float | None = Field(
        10.0,
        gt=0,
        le=3600,
        description="With several broker endpoints (`mqtt.endpoints`): connected, but no "
        "control message for this long, the agent moves to the next endpoint (its broker "
        "node may be cut off from the others). Doubles after each such move while no "
        "endpoint brings control, up to 5 minutes. None: never. Keep it well under the "
        "control lease.",
    )
    reassert: bool = Field(
        True, description="Re-apply caps that something else changed, with an event."
    )
    accept_remote_policy: bool = Field(
        True,
        description="Apply the node policy the aggregator publishes (validated again here, "
        "kept as a last good copy in state_dir); it then takes precedence over policy_file.",
    )
    control_issuers: tuple[str, ...] = Field(
        (),
        description="The aggregator instances (their instance setting) whose control "
        "messages this node follows; control from any other issuer is refused and counted. "
        "Empty follows any issuer, with a warning at start-up.",
    )
    clock_skew_tolerance_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="How far a controller's wall-clock stamps may differ from this node's "
        "clock before the agent reports a skew and refuses epochs from the future. Leases "
        "run on the monotonic clock whatever the skew.",
    )
    crash_loop_after: int = Field(
        3,
        ge=2,
        description="Report a crash loop (log, systemd STATUS=, MQTT status) when the agent "
        "ended this many times in a row with the same failure.",
    )
    class_dwell_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="After a GPU's runtime priority class changes (the scheduler's "
        "assignment), a further change of that GPU waits this long; the latest assignment "
        "then applies (flips in between are coalesced, none is lost). Bounds the cap writes "
        "a flapping assignment can cause. 0: every change applies at once.",
    )
    max_term_step: int = Field(
        2**32,
        ge=1,
        le=2**62,
        description="A control message whose leadership term is more than this above the "
        "highest term accepted is refused (control_term_jump) while a lease of the current "
        "term runs, and accepted once it lapsed: a forged term cannot fence out a live "
        "controller. Terms are etcd create-revisions, which grow with every write to the "
        "etcd cluster (docs/ha.md), so a new leader's term exceeds the old one's by the "
        "writes during the old one's tenure; a larger step only delays a takeover until "
        "the old lease lapses.",
    )
    max_term: int = Field(
        2**40,
        ge=1,
        le=2**63 - 1,
        description="A control message whose leadership term is above this is refused "
        "always (control_term_jump), the first one this node sees included: terms are etcd "
        "create-revisions, and an etcd cluster the aggregators elect on does not reach a "
        "trillion writes, so such a term is forged and may not fence out the real "
        "controller that comes after it.",
    )


class Settings(ProcessSettings):
    """All settings of the node agent."""

    topics: TopicSettings = Field(default_factory=TopicSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    assignment: AssignmentSettings = Field(default_factory=AssignmentSettings)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """The node agent's settings from YAML, the environment and ``overrides``."""
    return load_settings_as(Settings, config_file, **overrides)
