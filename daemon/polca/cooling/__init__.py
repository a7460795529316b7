"""Liquid cooling: the sources of CDU telemetry, and the supervision of the loops they serve.

Sources (run as ``polca cdu``): a simulated cooling plant (``polca.cooling.plant``:
``SimulatedCdu``, assembled from the loop's physics ``.plant_model``, its instruments
``.sensors``, its ratings ``.ratings``, its readings ``.sample`` and the coolant's
constants ``.coolant``; fault kinds ``.faults``; long reproducible runs ``.traces``), a
Modbus TCP poller (``.modbus``, over ``polca.modbus``; the CDU's register map
``.registers``), their publishers (``.publisher``), process settings (``.config``) and
command line (``.cli``).

Supervision (pure, run by the aggregator): the loops' settings (``.loops``), the supervisor
(``.supervisor``) and its parts: alarm specs and their engine (``.alarms``, ``.debounce``),
capacity and thermal budgets (``.budgets``), heat balance (``.heat``), the evidence of one
instant (``.evidence``).

The public names live in the modules; this package imports none of them, so that
``polca`` starts fast and only ``polca.cooling.modbus`` pulls in ``pymodbus`` (through
``polca.modbus.client``).
"""
