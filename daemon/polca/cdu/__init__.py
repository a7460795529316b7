"""CDU telemetry sources (``polca cdu``): pollers of real CDUs and the simulated plant's publisher.

A Modbus TCP poller (``.modbus``, over ``polca.modbus``; the CDU's register map
``.registers``), a Redfish poller (``.redfish``, over ``polca.redfish``), the outage
handling both share (``.outage``), the loops that publish a poller's or the simulated
plant's (``polca.plant``) readings (``.publisher``), process settings (``.config``) and
command line (``.cli``).

The public names live in the modules; this package imports none of them, so that only
``polca.cdu.modbus`` pulls in ``pymodbus`` (through ``polca.modbus.client``).
"""
