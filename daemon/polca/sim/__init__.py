"""The trace-driven oversubscription simulator and capacity planner.

``polca simulate`` replays an LLM request trace on a simulated row of GPU servers whose
caps come from the production policy engine (``polca.policy.decide`` and ``next_level``,
the very functions the node agent and the aggregator run), and reports what the caps cost
against an uncapped run; ``polca plan`` sweeps oversubscription for the largest row that
meets latency SLOs with zero power-brake events. ``docs/simulator.md`` describes the
model and where its constants come from; ``docs/evaluation.md`` has the results.

Modules: ``model`` (the per-phase GPU serving model, on ``polca.physics``' power curve;
servers, rows and configuration), ``profile`` (the model's constants, one YAML file per
GPU), ``workload`` (trace to requests), ``runner`` (the time-stepped simulation),
``scenario`` (inputs to runs), ``report`` (metrics and files), ``plots`` (PNG, optional
matplotlib), ``plan`` (the sweep), ``failover`` (a feed's loss replayed on a Flex row:
``polca plan --feed-failure``), ``power_history`` (a row's recorded power, read from a
CSV or InfluxDB, and resampled), ``history`` (plans from that history: ``polca plan
--history``), ``agreement`` (the simulator against a recorded ``polca demo`` run),
``calibrate`` and ``published`` (a profile fitted to a clock sweep, and held to
published measurements), ``cli``, ``durations`` and ``commands`` (the command line).
Everything but ``cli``, ``durations`` and ``profile`` needs numpy (the ``polca[sim]``
extra), so this package imports nothing on its own.
"""
