"""Liquid cooling supervision (pure, run by the aggregator): the loops and the racks they serve.

The loops' settings (``.loops``), the supervisor (``.supervisor``) and its parts: alarm
specs and their engine (``.alarms``, ``.debounce``), capacity and thermal budgets
(``.budgets``), heat balance (``.heat``), the evidence of one instant (``.evidence``).
The sources of CDU telemetry are ``polca.cdu`` (``polca cdu``) and the simulated plant
``polca.plant``.

The public names live in the modules; this package imports none of them, so that
``polca`` starts fast.
"""
