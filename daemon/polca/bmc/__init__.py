"""Out-of-band power caps through a node's BMC (Redfish), for nodes whose agent cannot cap."""
