"""Sources of CDU telemetry: the simulated cooling plant, the Modbus poller, the publishers."""
