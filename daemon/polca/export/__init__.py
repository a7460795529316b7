"""The export path: points, the sinks they go to, and the InfluxDB sink with its spool.

``points.py`` is the data model and the schema of every point polca writes; ``sink.py``
the ``Sink`` protocol, the fan-out over many sinks, and a memory sink; ``influx.py`` the
InfluxDB (or VictoriaMetrics) sink, ``transport.py`` its HTTP write APIs and ``spool.py``
its on-disk spool. Builders from the aggregator's results live in ``aggregator/points.py``.
"""
