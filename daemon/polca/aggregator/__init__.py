"""The central aggregator: row rollups, the POLCA row controller, and the telemetry sink.

Start-up order (``runtime.Aggregator.start``): note the run in the exit record (a crash
loop is reported) -> load the policy (fatal if invalid) -> make the buses
(``connections.make_buses``) -> systemd READY=1 -> connections (``mqtt``, which outlives
the loops so the final status goes out; ``mqtt-<name>``, the intake's; ``sinks``;
``etcd`` with ``ha``) and loops (``control``: every interval, or at once when woken;
``bmc`` with BMCs; ``polca.service``'s side tasks).

Shutdown order: close the BMC sessions (caps in force stay) -> resign the lead -> close
the sinks, the intake connections, the control one with the final ``offline`` status
(``stopped`` after a clean stop, else ``failed``); each bounded by
``polca.service.STOP_BOUNDS``.
"""
