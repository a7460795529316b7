"""Modbus TCP: the one client polca speaks it with, and the decoding of register maps.

``polca.modbus.client`` is the seam (``RegisterClient``, ``PymodbusClient``: the only
importer of ``pymodbus``); ``polca.modbus.registers`` the pure decoding every map shares
(``RegisterPoint``, ``plan_reads``, ``decode_point``). What a map's fields mean is its
reader's: a CDU's in ``polca.cdu.registers``, a meter's in ``polca.meter.modbus``.

The public names live in the modules; this package imports none of them, so that only a
process that talks Modbus pulls in ``pymodbus``.
"""
