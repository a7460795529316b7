"""What simulated GPUs are asked to do: load profiles, request traces and their replay.

The simulated backend (``polca.gpu.simulated``) and the demo need a GPU's utilization over
time; this package supplies it and nothing else: how a GPU responds (clocks, power, heat)
is ``polca.physics`` and the backend's, never this package's. It sits below the hardware
seam and imports no GPU code, no settings and no transport.

Modules: ``profiles`` (utilization as a pure function of time, and the settings names of
the shapes), ``trace`` (reading a request trace, a hostile file), ``serving`` (how fast a
GPU type serves prefill and decode), ``replay`` (a trace served on a row of GPUs, as one
profile per GPU).
"""

from polca.workload.profiles import LoadProfile, load_profile
from polca.workload.replay import TraceReplay, trace_loads
from polca.workload.trace import Trace, TraceError

__all__ = ["LoadProfile", "Trace", "TraceError", "TraceReplay", "load_profile", "trace_loads"]
