"""The most each data-center GPU product can be limited to, by the name NVML reports (pure).

The aggregator bounds what a node may claim by what its GPUs can draw (``aggregator/
rollup.py`` ``NodeView.learn``). A node's own telemetry declares each GPU's maximum power
limit, but that is the node's word: a node that declares 10 kW per GPU would raise its own
bound. Where the topology sets no ``gpu_max_power_w`` or ``nameplate_w``, the bound comes
from this table of published maximum power limits (the vendors' data sheets: the largest
configurable limit of the product, liquid-cooled variants included), never above it
whatever the node declares. A product not in the table falls back to the node's declared
maximum, cut to ``intake.max_gpu_power_w``, and the aggregator says so once per node
(``node_bound_declared``).

Values err high (a bound below what the product draws would count a real node low): each is
the product's highest published limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["PUBLISHED_MAX_POWER_W", "published_max_power_w"]

PUBLISHED_MAX_POWER_W: Final[Mapping[str, float]] = {
    # Ampere. HGX A100 80 GB has a 500 W liquid-cooled configuration.
    "NVIDIA A100-SXM4-40GB": 400.0,
    "NVIDIA A100-SXM4-80GB": 500.0,
    "NVIDIA A100-PCIE-40GB": 250.0,
    "NVIDIA A100 80GB PCIe": 300.0,
    "NVIDIA A30": 165.0,
    "NVIDIA A40": 300.0,
    "NVIDIA A10": 150.0,
    # Ada.
    "NVIDIA L4": 75.0,
    "NVIDIA L40": 300.0,
    "NVIDIA L40S": 350.0,
    # Hopper.
    "NVIDIA H100 80GB HBM3": 700.0,
    "NVIDIA H100 PCIe": 350.0,
    "NVIDIA H100 NVL": 400.0,
    "NVIDIA H800": 700.0,
    "NVIDIA H200": 700.0,
    "NVIDIA H200 NVL": 600.0,
    "NVIDIA GH200 480GB": 1000.0,
    "NVIDIA GH200 144G HBM3e": 1000.0,
    # Blackwell (module limits of the superchips: GPU and its share of the CPU).
    "NVIDIA B200": 1200.0,
    "NVIDIA GB200": 1200.0,
    "NVIDIA B300 SXM6 AC": 1400.0,
    "NVIDIA GB300": 1400.0,
}
"""Product name as ``nvmlDeviceGetName`` returns it -> its highest published power limit, W."""

_BY_KEY: Final = {" ".join(name.casefold().split()): w for name, w in PUBLISHED_MAX_POWER_W.items()}


def published_max_power_w(product_name: str | None) -> float | None:
    """The product's highest published power limit in W, or None for a product not in the
    table (names compared without regard to case or runs of spaces)."""
    if not product_name:
        return None
    return _BY_KEY.get(" ".join(product_name[:128].casefold().split()))
