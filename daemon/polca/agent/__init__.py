"""The node agent: samples GPUs, applies the policy engine's caps, talks MQTT.

Start-up order (``runtime.Agent.start``): note the run in the exit record (a crash loop
is reported) -> open the GPU backend on its worker thread -> discover GPUs -> check write
privilege (unless observe-only) -> load the policy -> if a baseline was left behind (a
crash, or a stop that kept caps), keep it as the originals and apply the fail-safe caps
before anything else -> save the baseline -> start the bus and the loops -> tell systemd
READY=1. The start-up grace (nominal until the first control message) applies only after
a clean, restoring stop.

Shutdown order: stop the loops -> leave the GPUs as the end requires (``core.plan_stop``:
``on_stop`` after a clean stop, the fail-safe after any other end; carried out by
``gpus.carry_out_stop``, shielded, bounded by ``agent.stop_timeout_s``) -> publish the
final state and an ``offline`` status, flush -> close the sinks (each bounded by
``polca.service.STOP_BOUNDS``) -> close the GPU backend -> note how the run ended.
"""
