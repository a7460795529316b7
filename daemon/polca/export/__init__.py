"""The export path: points, the sinks they go to, and the InfluxDB sink with its spool.

``schema.py`` is the schema of every point polca writes (``SCHEMA``, and which
measurements are essential or bulk); ``points.py`` the points checked against it
(``make_point``, ``LineTemplate``) and their line protocol; ``gpus.py`` the points of a
node's telemetry message; ``schedule.py`` how often each measurement is written
(``WriteSchedule``, and ``Thinning`` as the aggregator applies it); ``sink.py`` the
``Sink`` protocol, the fan-out over many sinks, and a memory sink; ``influx.py`` the
InfluxDB (or VictoriaMetrics) sink, ``transport.py`` its HTTP write APIs and ``spool.py``
its on-disk spool; ``prometheus.py`` the ``/metrics`` sink. Builders from the
aggregator's results live in ``aggregator/points.py``, the agent's in ``agent/points.py``.
"""
