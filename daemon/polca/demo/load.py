"""The demo row's load: which replay each node's GPUs serve, and that load uncapped.

The row serves several services (``tenants``), each the bundled Azure trace replayed at
its own phase (``tenant_replays``); ``node_gpus`` builds a node's simulated GPUs serving
its tenant's share. The runtime gives these GPUs to the agents (and the same again, never
capped, to the counterfactual); ``uncapped_load`` runs the counterfactual alone on a
simulated clock, without the daemons: what ``polca plan --history`` takes to sign the
demo's budget and policy (``bench/demo_plan.py``, ``tests/test_demo.py``). No I/O beyond
loading the bundled trace and the policy file.
"""

from __future__ import annotations

from collections.abc import Callable

from polca.demo.counterfactual import ClassClocks, Counterfactual
from polca.demo.options import DemoOptions
from polca.demo.view import DemoView
from polca.gpu.simulated import SimulatedBackend
from polca.policy import Policy, load_policy
from polca.workload.replay import TraceReplay, trace_loads
from polca.workload.trace import Trace

__all__ = ["gpu_classes", "node_gpus", "tenant_replays", "uncapped_load"]


def tenant_replays(options: DemoOptions, trace: Trace) -> list[tuple[TraceReplay, int]]:
    """Per node of the row: the replay of its tenant and its place among the tenant's nodes.

    The row serves ``tenants`` services, each the bundled trace started at its own phase
    (spread evenly over one lap of the trace) with its own seed, its share of ``scale`` and
    its nodes dealt in turn (node ``n`` serves tenant ``n % tenants``), so that every rack
    carries every tenant. One tenant makes the row follow the trace's minute-scale bursts;
    several at independent phases smooth the row as services sharing a real row do
    (docs/evaluation.md §6). More tenants than nodes make one per node.
    """
    nodes = len(options.nodes)
    if options.tenants < 1:
        msg = f"tenants must be at least 1, got {options.tenants}"
        raise ValueError(msg)
    tenants = min(options.tenants, nodes)  # more tenants than nodes: one per node
    replays = []
    for k in range(tenants):
        share = len(range(k, nodes, tenants))  # nodes of tenant k
        replays.append(
            TraceReplay(
                trace,
                gpus=share * options.gpus_per_node,
                speedup=options.speedup,
                scale=options.scale * share / nodes,
                offset_s=options.offset_s + k * trace.duration_s / tenants,
                seed=options.seed * 100 + k,
                serving=options.model,
            )
        )
    return [(replays[n % tenants], n // tenants) for n in range(nodes)]


def node_gpus(
    options: DemoOptions,
    number: int,
    replay: tuple[TraceReplay, int],
    clock: Callable[[], float] | None = None,
) -> SimulatedBackend:
    """Node ``number``'s simulated GPUs, each serving its share of its tenant's replay."""
    backend = SimulatedBackend(
        count=options.gpus_per_node,
        model=options.model,
        load="idle",
        seed=options.seed * 1000 + number,
        clock=clock,
    )
    tenant, local = replay
    for index, profile in enumerate(
        trace_loads(options.gpus_per_node, node_offset=local, replay=tenant)
    ):
        backend.set_load(index, profile)
    return backend


def gpu_classes(policy: Policy, gpus_per_node: int) -> dict[int, str]:
    """GPU index -> priority class, as the policy assigns a node's GPUs statically."""
    return {i: policy.static_class(index=i, uuid="") for i in range(gpus_per_node)}


def uncapped_load(options: DemoOptions, duration_s: float) -> DemoView:
    """The demo row's uncapped load over ``duration_s`` without the daemons: the run's
    counterfactual (the same GPUs and replays) on a simulated clock, sampled at the agents'
    interval and recorded as 1 s means in a ``DemoView`` (``uncapped_record``,
    ``write_uncapped``). What ``polca plan --history`` takes to sign the demo's budget and
    policy (``bench/demo_plan.py``, ``tests/test_demo.py``)."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    replays = tenant_replays(options, Trace.load())
    backends = [node_gpus(options, n, replays[n], clock) for n in range(len(options.nodes))]
    policy = load_policy(options.policy).policy
    view = DemoView(options, options.row_budget_w(), clock=clock, started_s=0.0)
    view.counterfactual = Counterfactual(
        backends, gpu_classes(policy, options.gpus_per_node), ClassClocks(options.model)
    )
    per_s = max(1, round(1.0 / options.sample_interval_s))
    for second in range(int(duration_s)):
        for k in range(per_s):
            now[0] = second + k / per_s
            view.sample_counterfactual()
        now[0] = second + 1.0
        view.tick()
    return view
