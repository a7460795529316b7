"""The demo row's shape and load (``DemoOptions``) and the names that stay fixed.

``polca demo``'s command line fills ``DemoOptions``; the runtime, the view, the load and
the planner's view of the row (``planner_row``) all read the row from it. The fixed parts:
the site, row and aggregator names of the demo's topics, each server's non-GPU power, the
CDU that serves each rack, and the shipped demo policy. Data and arithmetic only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from polca.physics.presets import get_model
from polca.plant.ratings import CduRatings

if TYPE_CHECKING:
    from polca.sim.agreement import DemoRow

__all__ = [
    "AGGREGATOR_INSTANCE",
    "CDU_RATINGS",
    "DEMO_POLICY",
    "NON_GPU_W",
    "ROW",
    "SITE",
    "DemoOptions",
]

DEMO_POLICY = Path(__file__).resolve().parents[3] / "policies" / "simulated-demo.yaml"
SITE = "demo"
AGGREGATOR_INSTANCE = "demo-aggregator"
ROW = "row1"
NON_GPU_W = 1500.0  # CPUs, memory, NICs and fans of an 8-GPU server
# One in-row CDU per rack, sized for a rack of four 8-GPU nodes (~35 kW at full load).
CDU_RATINGS = CduRatings(heat_capacity_kw=40.0, design_flow_lpm=60.0)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """The shape of the demo row and its load."""

    racks: int = 3
    nodes_per_rack: int = 4
    gpus_per_node: int = 8
    model: str = "H100-SXM"
    budget_w: float | None = None  # default: budget_fraction of the row's nameplate
    budget_fraction: float = 0.775  # the smallest the planner signs for this load (§6)
    speedup: float = 2.0
    scale: float = 16.0
    tenants: int = 4  # services at independent phases of the trace, nodes dealt in turn
    offset_s: float = 756.0  # trace seconds skipped: the largest burst of a lap comes ~1 min in
    seed: int = 0
    policy: Path = DEMO_POLICY
    duration_s: float | None = None
    influx_url: str | None = None
    influx_api: str = "v2"  # v1 for InfluxDB 1.x (database "polca")
    broker: tuple[str, int] | None = None
    sample_interval_s: float = 0.25
    incident_at_s: float | None = 45.0  # a CDU pump fails this long after the start
    incident_s: float = 30.0  # ... and is repaired after this long
    feed_loss_at_s: float | None = 20.0  # the row's feed B is lost this long after the start
    feed_loss_s: float = 15.0  # ... and comes back after this long
    feed_fraction: float = 0.6  # each of the row's two feeds carries this much of its budget
    record_dir: Path | None = None  # write the run's row and uncapped power here (CSV)

    @property
    def nodes(self) -> list[tuple[str, str]]:
        """(rack, node) for every node of the row."""
        return [
            (f"rack{r + 1}", f"node{r + 1}{n + 1:02d}")
            for r in range(self.racks)
            for n in range(self.nodes_per_rack)
        ]

    def row_budget_w(self) -> float:
        """The row's budget: ``budget_w``, else ``budget_fraction`` of the nameplate."""
        return self.budget_w or self.budget_fraction * self.nameplate_w()

    def planner_row(self) -> DemoRow:
        """The row as the simulator sees it (``polca.sim.agreement``: the agreement check
        and ``plan_demo_row``)."""
        from polca.sim.agreement import DemoRow  # noqa: PLC0415 - numpy: the sim extra

        return DemoRow(
            budget_w=self.row_budget_w(),
            servers=len(self.nodes),
            gpus_per_server=self.gpus_per_node,
            model=self.model,
            non_gpu_w=NON_GPU_W,
        )

    def nameplate_w(self) -> float:
        """The row's nameplate: every GPU at its default limit plus non-GPU power."""
        gpu_w = get_model(self.model).tdp_mw / 1000.0
        return len(self.nodes) * (self.gpus_per_node * gpu_w + NON_GPU_W)
