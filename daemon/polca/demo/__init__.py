"""``polca demo``: a whole oversubscribed row on one machine, with nothing to install.

One process runs an embedded MQTT broker (or uses ``--broker``), the aggregator, and a row
of simulated nodes (racks of 8-GPU nodes) serving LLM-inference load replayed from the
bundled Azure request trace by several services (``tenants``) at their own phases. The
row's budget is the smallest the planner signs for this load and policy (``polca plan
--history`` on ``uncapped_load``, ``bench/demo_plan.py``): below what the load can draw at
its bursts, so the controller really caps, within POLCA's SLOs. A live view shows row
power against the budget and thresholds, the level, per-rack power and the hottest GPUs;
``--influx URL`` also writes everything to InfluxDB; ``--duration`` bounds the run, which
ends with a summary: time at each level, brake events, capping events and peak row power
as % of budget. Beside the row, a counterfactual runs the same GPUs under the same load
uncapped (the replay's load does not depend on the caps), so the view and the summary show
what polca buys: the uncapped peak, the servers the budget would hold at it, and the clock
each class gave up.

Everything here is the production code: agents, aggregator, policy engine, MQTT; only the
GPUs are simulated. The parts:

- ``options``: the shape of the row and its load (``DemoOptions``), its fixed names;
- ``load``: the row's simulated GPUs and the replay each serves, and ``uncapped_load``,
  the row's load without the daemons (what the planner signs);
- ``counterfactual``: the same GPUs never capped, and the clock and slowdown per class;
- ``view``: the live view and the closing summary, and the run's record (CSV);
- ``runtime``: ``run_demo``, which starts the daemons, runs them and stops them in order.

The public names live in the modules; this package imports none of them, so that the
planner's and the tests' use of ``load`` does not import the daemons (``runtime`` does).
"""
