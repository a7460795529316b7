"""Row power from the site's PDUs and meters (``polca meter``): SNMP, Redfish, Modbus TCP."""
