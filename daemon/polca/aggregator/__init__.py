"""The central aggregator: row rollups, the POLCA row controller, and the telemetry sink."""
