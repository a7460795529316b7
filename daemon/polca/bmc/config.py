"""Settings of out-of-band caps: which nodes have a BMC polca may cap, and how.

Part of the aggregator's settings (``bmc:``); ``docs/facility.md`` walks through it. A
node's BMC is a ``RedfishEndpoint`` (HTTPS with CA verification unless a lab says
otherwise; the password from a file or a systemd credential, never the YAML) and the two
limits polca writes there: ``fail_safe_w`` (its agent cannot cap it and its scope is at
a capping level) and ``brake_w`` (the same at the policy's top level). Both are whole-node
limits in watts, as the BMC's power control takes them.
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polca.redfish.api import RedfishEndpoint
from polca.settings import TOPIC_SEGMENT

__all__ = ["BmcNode", "BmcSettings"]

_NODE = Annotated[str, Field(pattern=TOPIC_SEGMENT)]  # as the node names its topics


class BmcNode(BaseModel):
    """One node's BMC and the limits polca writes there."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    endpoint: RedfishEndpoint = Field(description="The BMC's Redfish service.")
    chassis: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="The chassis id of this node, when the service serves several (an "
        "enclosure manager); default: found by discovery.",
    )
    control: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_./:-]{1,256}$",
        description="The power control that caps this node (its path, or its last segment), "
        "when its chassis has several that discovery cannot tell apart (polca bmc probe "
        "lists them); default: the one marked as the whole node's.",
    )
    fail_safe_w: float = Field(gt=0, le=100_000, description="Node limit when its agent cannot.")
    brake_w: float | None = Field(
        None, gt=0, le=100_000, description="Node limit at the brake level (default fail_safe_w)."
    )

    @property
    def brake_limit_w(self) -> float:
        """The limit written at the brake level."""
        return self.brake_w if self.brake_w is not None else self.fail_safe_w

    @model_validator(mode="after")
    def _brake_not_above(self) -> Self:
        if self.brake_w is not None and self.brake_w > self.fail_safe_w:
            msg = f"brake_w ({self.brake_w:g}) must not exceed fail_safe_w ({self.fail_safe_w:g})"
            raise ValueError(msg)
        return self


class BmcSettings(BaseModel):
    """Out-of-band caps through the nodes' BMCs (off while ``nodes`` is empty)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    cap_from_level: int = Field(
        1,
        ge=1,
        le=64,
        description="Scope level at or over which a node whose agent cannot "
        "cap it is capped through its BMC.",
    )
    agent_back_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="How long an agent must be back in control (fresh, "
        "not in fail-safe) before its node's out-of-band cap may be lifted.",
    )
    min_write_interval_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="Least time between two writes to one BMC (a failed "
        "or unverified write is retried at this pace).",
    )
    nodes: dict[_NODE, BmcNode] = Field(
        default_factory=dict, max_length=100_000, description="Node name -> its BMC."
    )
