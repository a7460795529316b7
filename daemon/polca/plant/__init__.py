"""The simulated cooling plant: a CDU and its loop, for the demo, ``polca cdu simulate`` and tests.

``SimulatedCdu`` (``.cdu``) is assembled from the loop's physics (``.model``), its
instruments (``.sensors``), its ratings (``.ratings``), its readings (``.sample``) and the
coolant's constants (``.coolant``); the fault kinds are ``.faults``, long reproducible
runs ``.traces``. Pure and free of I/O: what publishes it is ``polca.cdu.publisher``.

The public names live in the modules; this package imports none of them.
"""
