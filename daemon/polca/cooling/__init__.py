"""Sources of CDU telemetry: a simulated cooling plant, a Modbus TCP poller, publishers.

The public names live in the modules (``polca.cooling.plant``, ``.registers``,
``.modbus``, ``.publisher``, ``.faults``, ``.config``, ``.cli``); this package imports none
of them, so that ``polca`` starts fast and only ``polca.cooling.modbus`` pulls in
``pymodbus``.
"""
