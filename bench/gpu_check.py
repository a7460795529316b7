"""The one-command check to run on a machine with a real NVIDIA GPU (under 5 minutes).

What it measures, on one GPU (``--gpu``, default 0), and writes to ``--out`` as JSON:

1. the latency (p50/p99) of every NVML read the agent makes, and of a whole
   ``NvmlBackend.sample``; which fields the GPU supports; how often the instant-power
   field really changes (the sensor period, which bounds a useful sampling rate);
2. a power limit of min + 100 W: how long the call takes, when ``GetEnforcedPowerLimit``
   shows it, and when measured power falls under it (meaningful under load);
3. an SM clock lock: the call time and when ``GetClockInfo(SM)`` reaches the lock;
4. the ``nvmlDeviceSetPowerManagementLimit_v2`` binding bug, with an out-of-range value:
   what the binding returned versus what the C function returned;
5. ``python -m polca agent --backend nvml`` for 30 s against a local Mosquitto (when
   installed): exit code, messages published, and whether it put the limits back;
6. with ``--profile-out FILE`` (and torch): a clock sweep for the planner. At six locked
   SM clocks from the maximum down to half, a compute-bound kernel (FP16 matmul, the
   prefill stand-in) and a memory-bound one (streaming a 2 GiB tensor, the decode
   stand-in) each run while their mean power and time per iteration are measured, after
   an idle reading; ``polca.sim.calibrate`` fits the profile's clock relations to them and
   FILE is a profile for ``polca simulate|plan --profile FILE``.

Load: with ``torch`` and CUDA available, a matmul loop runs on the GPU in a subprocess
during steps 2-3 (``--no-load`` to skip); otherwise the readings are idle ones.

Everything it changes is put back in a ``finally``: SM clocks reset, power limits set to the
values read at the start. Writes need root or CAP_SYS_ADMIN; without them the write steps
are recorded as refused and the rest still runs. ``--no-writes`` skips steps 2-5.

    sudo .venv/bin/python bench/gpu_check.py --out gpu_check.json

It imports nothing GPU-related at module level, so ``--help`` works anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SAMPLE_FIELDS = (186, 185, 82, 191)  # POWER_INSTANT, POWER_AVERAGE, MEMORY_TEMP, ENERGY
POLL_INTERVAL_S = 0.005
LOAD_SCRIPT = """
import sys, time
import torch

device = torch.device("cuda", int(sys.argv[1]))
end = time.monotonic() + float(sys.argv[2])
a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
b = torch.randn_like(a)
torch.cuda.synchronize(device)
print("ready", flush=True)
while time.monotonic() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize(device)
"""


SWEEP_SCRIPT = """
import sys, time
import torch

device = torch.device("cuda", int(sys.argv[1]))
mode, seconds = sys.argv[2], float(sys.argv[3])
if mode == "matmul":
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    b = torch.randn_like(a)
    def step():
        return a @ b
else:
    a = torch.empty(2**30, device=device, dtype=torch.float16)
    b = torch.empty_like(a)
    def step():
        b.copy_(a)
step()
torch.cuda.synchronize(device)
print("ready", flush=True)
n, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    for _ in range(10):
        step()
    torch.cuda.synchronize(device)
    n += 10
print("iter_s", (time.perf_counter() - start) / n, flush=True)
"""
SWEEP_CLOCK_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


# ---- small helpers ----------------------------------------------------------------------


def percentiles_us(samples_s: list[float]) -> dict[str, float]:
    """p50/p99/max of durations given in seconds, in microseconds."""
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": p99 * 1e6,
        "max_us": ordered[-1] * 1e6,
        "n": len(ordered),
    }


def time_call(fn: Callable[[], object], iterations: int) -> dict[str, Any]:
    """Call ``fn`` ``iterations`` times; its latency figures, or the error it raised."""
    durations: list[float] = []
    try:
        for _ in range(iterations):
            start = time.perf_counter()
            fn()
            durations.append(time.perf_counter() - start)
    except Exception as exc:  # a failing read is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    return percentiles_us(durations)


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, trace: Callable[[float], None] | None = None
) -> float | None:
    """Seconds until ``predicate()`` holds (polled every 5 ms), or None on timeout."""
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if trace is not None:
            trace(elapsed)
        if predicate():
            return elapsed
        if elapsed >= timeout_s:
            return None
        time.sleep(POLL_INTERVAL_S)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tail(text: str, limit: int = 4000) -> str:
    """The last ``limit`` characters of ``text``."""
    return text[-limit:]


def _torch_child(script: str, *args: str) -> subprocess.Popen[str]:
    """``script`` in a child Python with CUDA indices in NVML's (PCI bus) order."""
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")  # CUDA index == NVML index
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def gpu_load(
    index: int, duration_s: float, enabled: bool, report: dict[str, Any]
) -> Iterator[bool]:
    """Run a matmul loop on GPU ``index`` in a subprocess (if torch+CUDA); yield whether busy."""
    if not enabled or importlib.util.find_spec("torch") is None:
        report["load"] = "idle (torch not installed)" if enabled else "idle (--no-load)"
        yield False
        return
    proc = _torch_child(LOAD_SCRIPT, str(index), str(duration_s))
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().strip() == "ready"
        report["load"] = "torch matmul loop" if ready else "idle (load failed to start)"
        if not ready:
            report["load_error"] = tail(proc.stderr.read() if proc.stderr else "", 2000)
        else:
            time.sleep(3.0)  # let power and clocks reach steady state
        yield ready
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the checks -----------------------------------------------------------------------------


def check_reads(
    pynvml: Any, handle: Any, index: int, iterations: int, window_s: float
) -> dict[str, Any]:
    """Latency of each read the agent makes, field support, and the power sensor period."""
    reads: dict[str, Callable[[], object]] = {
        "nvmlDeviceGetFieldValues[186,185,82,191]": lambda: pynvml.nvmlDeviceGetFieldValues(
            handle, list(SAMPLE_FIELDS)
        ),
        "nvmlDeviceGetTemperatureV(GPU)": lambda: pynvml.nvmlDeviceGetTemperatureV(
            handle, pynvml.NVML_TEMPERATURE_GPU
        ),
        "nvmlDeviceGetClockInfo(SM)": lambda: pynvml.nvmlDeviceGetClockInfo(
            handle, pynvml.NVML_CLOCK_SM
        ),
        "nvmlDeviceGetClockInfo(MEM)": lambda: pynvml.nvmlDeviceGetClockInfo(
            handle, pynvml.NVML_CLOCK_MEM
        ),
        "nvmlDeviceGetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
        "nvmlDeviceGetPowerManagementLimit": lambda: pynvml.nvmlDeviceGetPowerManagementLimit(
            handle
        ),
        "nvmlDeviceGetEnforcedPowerLimit": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle),
        "nvmlDeviceGetCurrentClocksEventReasons": (
            lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        ),
        "nvmlDeviceGetPowerUsage": lambda: pynvml.nvmlDeviceGetPowerUsage(handle),
        "nvmlDeviceGetTotalEnergyConsumption": (
            lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        ),
    }
    result: dict[str, Any] = {name: time_call(fn, iterations) for name, fn in reads.items()}
    entries = pynvml.nvmlDeviceGetFieldValues(handle, list(SAMPLE_FIELDS))
    result["field_return_codes"] = {int(e.fieldId): int(e.nvmlReturn) for e in entries}
    result["power_sensor"] = power_sensor_period(pynvml, handle, 2 * window_s)
    try:
        import structlog

        from polca.gpu.nvml import NvmlBackend

        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
        backend = NvmlBackend()
        try:
            backend.discover()
            result["NvmlBackend.sample"] = time_call(lambda: backend.sample(index), iterations)
            result["sample_example"] = repr(backend.sample(index))
        finally:
            backend.close()
    except Exception as exc:  # polca not importable here is a finding
        result["NvmlBackend.sample"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def power_sensor_period(pynvml: Any, handle: Any, duration_s: float) -> dict[str, Any]:
    """How often the instant-power field gets a new driver timestamp (polled every 1 ms)."""
    stamps: list[int] = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        entry = pynvml.nvmlDeviceGetFieldValues(handle, [SAMPLE_FIELDS[0]])[0]
        if entry.nvmlReturn == 0 and (not stamps or entry.timestamp != stamps[-1]):
            stamps.append(int(entry.timestamp))
        time.sleep(0.001)
    gaps_ms = [(b - a) / 1000 for a, b in itertools.pairwise(stamps)]
    return {
        "distinct_timestamps": len(stamps),
        "median_update_ms": statistics.median(gaps_ms) if gaps_ms else None,
        "window_s": duration_s,
    }


def instant_power_mw(pynvml: Any, handle: Any) -> int | None:
    """The instant-power field (or GetPowerUsage where the field is unsupported)."""
    entry = pynvml.nvmlDeviceGetFieldValues(handle, [SAMPLE_FIELDS[0]])[0]
    if entry.nvmlReturn == 0:
        return int(entry.value.uiVal)
    return int(pynvml.nvmlDeviceGetPowerUsage(handle))


def mean_power_mw(pynvml: Any, handle: Any, duration_s: float) -> float:
    """Mean instant power over ``duration_s``."""
    readings: list[int] = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        value = instant_power_mw(pynvml, handle)
        if value is not None:
            readings.append(value)
        time.sleep(0.01)
    return statistics.fmean(readings) if readings else float("nan")


def check_power_limit(
    pynvml: Any, handle: Any, settle_s: float, busy: bool, window_s: float
) -> dict[str, Any]:
    """Set min + 100 W; time the call, the enforced limit and the measured power."""
    min_mw, max_mw = (int(v) for v in pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle))
    original_mw = int(pynvml.nvmlDeviceGetPowerManagementLimit(handle))
    target_mw = min(min_mw + 100_000, max_mw)
    result: dict[str, Any] = {
        "min_mw": min_mw,
        "max_mw": max_mw,
        "original_mw": original_mw,
        "target_mw": target_mw,
        "busy": busy,
        "power_before_mw": mean_power_mw(pynvml, handle, window_s),
    }
    trace: list[tuple[float, int | None]] = []
    last_trace = [-1.0]

    def record(elapsed_s: float) -> None:
        if elapsed_s - last_trace[0] >= 0.02:
            last_trace[0] = elapsed_s
            trace.append((round(elapsed_s, 4), instant_power_mw(pynvml, handle)))

    start = time.perf_counter()
    pynvml.nvmlDeviceSetPowerManagementLimit(handle, target_mw)
    result["set_call_ms"] = (time.perf_counter() - start) * 1000
    enforced_s = wait_until(
        lambda: int(pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)) == target_mw, settle_s
    )
    result["enforced_after_ms"] = None if enforced_s is None else enforced_s * 1000
    if result["power_before_mw"] > target_mw:
        below_s = wait_until(
            lambda: (instant_power_mw(pynvml, handle) or 0) <= target_mw * 1.05, settle_s, record
        )
        result["power_under_limit_after_ms"] = None if below_s is None else below_s * 1000
    else:
        result["power_under_limit_after_ms"] = "n/a: power already below the target"
    result["power_after_mw"] = mean_power_mw(pynvml, handle, window_s)
    result["power_trace_s_mw"] = trace[:500]
    start = time.perf_counter()
    pynvml.nvmlDeviceSetPowerManagementLimit(handle, original_mw)
    result["restore_call_ms"] = (time.perf_counter() - start) * 1000
    restored_s = wait_until(
        lambda: int(pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)) == original_mw, settle_s
    )
    result["restored_after_ms"] = None if restored_s is None else restored_s * 1000
    return result


def check_clock_lock(
    pynvml: Any, handle: Any, settle_s: float, busy: bool, window_s: float
) -> dict[str, Any]:
    """Lock the SM clock at about 60 % of max; time the call and the clock reaching it."""
    from polca.gpu.clocks import snap_sm_clock_mhz

    max_mhz = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    memory_mhz = pynvml.nvmlDeviceGetSupportedMemoryClocks(handle)
    supported = pynvml.nvmlDeviceGetSupportedGraphicsClocks(handle, max(memory_mhz))
    target_mhz = snap_sm_clock_mhz(int(max_mhz * 0.6), [int(v) for v in supported])
    result: dict[str, Any] = {
        "max_mhz": max_mhz,
        "target_mhz": target_mhz,
        "busy": busy,
        "sm_clock_before_mhz": int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        "power_before_mw": mean_power_mw(pynvml, handle, window_s),
    }

    def sm_mhz() -> int:
        return int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))

    start = time.perf_counter()
    pynvml.nvmlDeviceSetGpuLockedClocks(handle, target_mhz, target_mhz)
    result["lock_call_ms"] = (time.perf_counter() - start) * 1000
    reached_s = wait_until(lambda: abs(sm_mhz() - target_mhz) <= 15, settle_s)
    result["clock_reached_after_ms"] = None if reached_s is None else reached_s * 1000
    result["sm_clock_locked_mhz"] = sm_mhz()
    result["power_locked_mw"] = mean_power_mw(pynvml, handle, window_s)
    start = time.perf_counter()
    pynvml.nvmlDeviceResetGpuLockedClocks(handle)
    result["reset_call_ms"] = (time.perf_counter() - start) * 1000
    released_s = wait_until(lambda: sm_mhz() > target_mhz + 15, settle_s)
    result["clock_released_after_ms"] = None if released_s is None else released_s * 1000
    return result


def run_kernel(
    pynvml: Any, handle: Any, index: int, mode: str, *, seconds: float, window_s: float
) -> tuple[float, float]:
    """(mean power in W over the middle of the run, seconds per iteration) of one kernel."""
    proc = _torch_child(SWEEP_SCRIPT, str(index), mode, str(seconds))
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            why = tail(proc.stderr.read() if proc.stderr else "", 500)
            msg = f"the {mode} kernel did not start: {why}"
            raise RuntimeError(msg)
        time.sleep(min(1.0, seconds / 4))  # power settles
        watts = mean_power_mw(pynvml, handle, window_s) / 1000.0
        line = proc.stdout.readline().split()
        proc.wait(timeout=seconds + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if len(line) != 2 or line[0] != "iter_s":
        msg = f"the {mode} kernel gave no timing"
        raise RuntimeError(msg)
    return watts, float(line[1])


def clock_sweep(
    pynvml: Any, handle: Any, index: int, seconds: float, window_s: float
) -> dict[str, Any]:
    """Idle power, then both kernels at each locked clock of ``SWEEP_CLOCK_FRACTIONS``."""
    from polca.gpu.clocks import snap_sm_clock_mhz

    if importlib.util.find_spec("torch") is None:
        return {"skipped": "torch not installed"}
    max_mhz = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    memory_mhz = pynvml.nvmlDeviceGetSupportedMemoryClocks(handle)
    supported = [
        int(v) for v in pynvml.nvmlDeviceGetSupportedGraphicsClocks(handle, max(memory_mhz))
    ]
    pynvml.nvmlDeviceResetGpuLockedClocks(handle)
    time.sleep(2.0)
    sweep: dict[str, Any] = {
        "max_mhz": max_mhz,
        "idle_w": mean_power_mw(pynvml, handle, max(window_s, 2.0)) / 1000.0,
        "matmul": [],
        "stream": [],
    }
    for fraction in SWEEP_CLOCK_FRACTIONS:
        mhz = snap_sm_clock_mhz(int(max_mhz * fraction), supported)
        pynvml.nvmlDeviceSetGpuLockedClocks(handle, mhz, mhz)
        for mode in ("matmul", "stream"):
            watts, iter_s = run_kernel(
                pynvml, handle, index, mode, seconds=seconds, window_s=window_s
            )
            sweep[mode].append({"sm_clock_mhz": mhz, "power_w": watts, "seconds_per_iter": iter_s})
    pynvml.nvmlDeviceResetGpuLockedClocks(handle)
    return sweep


def base_profile_name(gpu_name: str) -> str:
    """The shipped profile closest to the GPU (H100 when unknown)."""
    name = gpu_name.upper()
    for key, profile in (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-sxm4")):
        if key in name:
            return "a100-sxm4-40gb" if profile == "a100-sxm4" and "40GB" in name else profile
    return "h100-sxm"


def write_profile(report: dict[str, Any], path: Path) -> str:
    """Fit the sweep in ``report`` onto the closest shipped profile; write it to ``path``."""
    from polca.sim.calibrate import SweepPoint, calibrated_profile
    from polca.sim.profile import shipped_profile

    sweep = report["sweep"]
    gpu = report["gpu"]
    base = shipped_profile(base_profile_name(str(gpu["name"])))
    where = f"{gpu['uuid']} ({gpu['name']}) on {report.get('started_at', '?')[:10]}"

    def points(mode: str) -> list[SweepPoint]:
        return [SweepPoint(**p) for p in sweep[mode]]

    text = calibrated_profile(
        base,
        name=f"{base.name}-measured",
        where=where,
        prefill=points("matmul"),
        decode=points("stream"),
        resident_w=sweep.get("idle_w"),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def check_v2_binding(pynvml: Any, handle: Any) -> dict[str, Any]:
    """Out-of-range limit via the _v2 binding (returns success) and via C (returns an error)."""
    _, max_mw = (int(v) for v in pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle))
    before_mw = int(pynvml.nvmlDeviceGetPowerManagementLimit(handle))
    bad_mw = max_mw + 100_000
    result: dict[str, Any] = {"value_mw": bad_mw, "limit_before_mw": before_mw}
    try:
        returned = pynvml.nvmlDeviceSetPowerManagementLimit_v2(
            handle, pynvml.NVML_POWER_SCOPE_GPU, bad_mw
        )
        result["binding_returned"] = int(returned)
    except pynvml.NVMLError as exc:
        result["binding_raised"] = f"{type(exc).__name__}: {exc}"
    value = pynvml.c_nvmlPowerValue_v2_t()
    value.version = pynvml.nvmlPowerValue_v2
    value.powerScope = pynvml.NVML_POWER_SCOPE_GPU
    value.powerValueMw = bad_mw
    c_function = pynvml._nvmlGetFunctionPointer("nvmlDeviceSetPowerManagementLimit_v2")
    result["c_function_returned"] = int(c_function(handle, ctypes.byref(value)))
    try:
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, bad_mw)
        result["v1_binding"] = "returned without error"
    except pynvml.NVMLError as exc:
        result["v1_binding"] = f"raised {type(exc).__name__} ({exc.value})"
    result["limit_after_mw"] = int(pynvml.nvmlDeviceGetPowerManagementLimit(handle))
    result["bug_confirmed"] = (
        result.get("binding_returned") == 0 and result["c_function_returned"] != 0
    )
    return result


def pick_policy(gpu_name: str) -> Path | None:
    """The repository's policy file closest to this GPU model, if any."""
    policies = REPO / "policies"
    for key, file_name in (("H100", "polca-h100.yaml"), ("H200", "polca-h100.yaml")):
        if key in gpu_name and (policies / file_name).exists():
            return policies / file_name
    if "A100" in gpu_name and (policies / "polca-a100.yaml").exists():
        return policies / "polca-a100.yaml"
    candidates = sorted(policies.glob("*.yaml")) if policies.is_dir() else []
    return candidates[0] if candidates else None


def write_agent_files(work: Path, port: int, gpu_name: str) -> Path | None:
    """Broker and agent configuration in ``work``; returns the policy file chosen."""
    (work / "mosquitto.conf").write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
    )
    policy = pick_policy(gpu_name)
    config = ["mqtt:", "  host: 127.0.0.1", f"  port: {port}", "agent:"]
    config.append(f"  state_dir: {work / 'state'}")
    if policy is not None:
        config.append(f"  policy_file: {policy}")
    (work / "agent.yaml").write_text("\n".join(config) + "\n")
    return policy


def run_agent(argv: list[str], seconds: float) -> dict[str, Any]:
    """Run the agent for ``seconds`` (SIGTERM after a grace period); exit code and output."""
    result: dict[str, Any] = {"argv": argv}
    start = time.perf_counter()
    agent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = agent.communicate(timeout=seconds + 20)
    except subprocess.TimeoutExpired:
        agent.send_signal(signal.SIGTERM)
        try:
            output, _ = agent.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
            output, _ = agent.communicate()
            result["killed"] = True
    result["ran_s"] = time.perf_counter() - start
    result["exit_code"] = agent.returncode
    result["output_tail"] = tail(output)
    return result


def check_agent(
    pynvml: Any, seconds: float, gpu_name: str, original_limits_mw: dict[int, int]
) -> dict[str, Any]:
    """Run ``python -m polca agent --backend nvml`` against a local Mosquitto for a while."""
    mosquitto = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if mosquitto is None:
        return {"skipped": "mosquitto not installed"}
    probe = subprocess.run(
        [sys.executable, "-m", "polca", "agent", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0 or "--config" not in probe.stdout:
        return {"skipped": "polca agent CLI unavailable", "help_output": tail(probe.stderr, 2000)}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="polca-gpu-check-") as directory:
        work = Path(directory)
        policy = write_agent_files(work, port, gpu_name)
        broker = subprocess.Popen(
            [mosquitto, "-c", str(work / "mosquitto.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        subscriber: subprocess.Popen[str] | None = None
        try:
            time.sleep(0.5)
            sub_tool = shutil.which("mosquitto_sub")
            if sub_tool is not None:
                subscriber = subprocess.Popen(
                    [sub_tool, "-h", "127.0.0.1", "-p", str(port), "-t", "#", "-v"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            argv = [sys.executable, "-m", "polca", "agent", "--config", str(work / "agent.yaml")]
            argv += ["--backend", "nvml", "--log-format", "json"]
            if "--duration" in probe.stdout:
                argv += ["--duration", str(seconds)]
            result = run_agent(argv, seconds)
            result["policy"] = None if policy is None else str(policy)
        finally:
            topics: list[str] = []
            if subscriber is not None:
                subscriber.terminate()
                lines, _ = subscriber.communicate(timeout=10)
                topics = [line.split(" ", 1)[0] for line in lines.splitlines() if line]
            broker.terminate()
            broker.wait(timeout=10)
    result["messages"] = len(topics)
    result["topics"] = sorted(set(topics))[:50]
    after = {
        index: int(
            pynvml.nvmlDeviceGetPowerManagementLimit(pynvml.nvmlDeviceGetHandleByIndex(index))
        )
        for index in original_limits_mw
    }
    result["limits_after_mw"] = after
    result["limits_restored_by_agent"] = after == original_limits_mw
    return result


# ---- orchestration -----------------------------------------------------------------------------


def run_checks(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Run every step into ``report``; restore the GPUs whatever happens."""
    import pynvml

    report["nvidia_ml_py"] = importlib.metadata.version("nvidia-ml-py")
    pynvml.nvmlInit()
    original_limits_mw: dict[int, int] = {}
    touched: set[int] = set()
    try:
        report["driver_version"] = pynvml.nvmlSystemGetDriverVersion()
        count = int(pynvml.nvmlDeviceGetCount())
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        handle = handles[args.gpu]
        gpu_name = str(pynvml.nvmlDeviceGetName(handle))
        report["gpu"] = {
            "index": args.gpu,
            "count": count,
            "name": gpu_name,
            "uuid": pynvml.nvmlDeviceGetUUID(handle),
        }
        for index, each in enumerate(handles):
            with contextlib.suppress(pynvml.NVMLError):
                original_limits_mw[index] = int(pynvml.nvmlDeviceGetPowerManagementLimit(each))
        report["original_limits_mw"] = original_limits_mw
        report["reads"] = check_reads(pynvml, handle, args.gpu, args.iterations, args.window_s)
        if args.no_writes:
            report["writes"] = "skipped (--no-writes)"
            return
        touched.add(args.gpu)
        with gpu_load(args.gpu, 60.0, not args.no_load, report) as busy:
            steps: dict[str, Callable[..., dict[str, Any]]] = {
                "power_limit": check_power_limit,
                "clock_lock": check_clock_lock,
            }
            for name, step in steps.items():
                try:
                    report[name] = step(pynvml, handle, args.settle_s, busy, args.window_s)
                except pynvml.NVMLError as exc:
                    report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if args.profile_out is not None:
            try:
                report["sweep"] = clock_sweep(
                    pynvml, handle, args.gpu, args.sweep_seconds, args.window_s
                )
                if "skipped" not in report["sweep"]:
                    report["profile"] = write_profile(report, args.profile_out)
            except (pynvml.NVMLError, RuntimeError, OSError, ValueError) as exc:
                report["sweep"] = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            report["v2_binding_bug"] = check_v2_binding(pynvml, handle)
        except pynvml.NVMLError as exc:
            report["v2_binding_bug"] = {"error": f"{type(exc).__name__}: {exc}"}
        if args.agent_seconds > 0:
            touched.update(range(count))
            try:
                report["agent"] = check_agent(
                    pynvml, args.agent_seconds, gpu_name, original_limits_mw
                )
            except (OSError, subprocess.SubprocessError) as exc:
                report["agent"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        report["restore"] = restore(pynvml, touched, original_limits_mw)
        pynvml.nvmlShutdown()
        report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def restore(pynvml: Any, touched: set[int], original_limits_mw: dict[int, int]) -> dict[str, str]:
    """Reset SM clocks and put the original power limits back on every touched GPU."""
    outcome: dict[str, str] = {}
    for index in sorted(touched):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            pynvml.nvmlDeviceResetGpuLockedClocks(handle)
            outcome[f"gpu{index}_clocks"] = "reset"
        except pynvml.NVMLError as exc:
            outcome[f"gpu{index}_clocks"] = f"{type(exc).__name__}: {exc}"
        limit_mw = original_limits_mw.get(index)
        if limit_mw is None:
            with contextlib.suppress(pynvml.NVMLError):
                limit_mw = int(pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle))
        if limit_mw is None:
            continue
        try:
            pynvml.nvmlDeviceSetPowerManagementLimit(handle, limit_mw)
            outcome[f"gpu{index}_power_limit"] = f"{limit_mw} mW"
        except pynvml.NVMLError as exc:
            outcome[f"gpu{index}_power_limit"] = f"{type(exc).__name__}: {exc}"
    return outcome


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the checks, write the JSON report."""
    parser = argparse.ArgumentParser(
        description="Time polca's NVML reads and writes on a real GPU, then restore it.",
        epilog="Writes need root or CAP_SYS_ADMIN. Runs in under 5 minutes.",
    )
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU (0)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="JSON report")
    parser.add_argument("--iterations", type=int, default=200, help="calls per read timing")
    parser.add_argument("--settle-s", type=float, default=10.0, help="wait for an effect (10)")
    parser.add_argument("--window-s", type=float, default=1.0, help="power averaging window (1.0)")
    parser.add_argument("--agent-seconds", type=float, default=30.0, help="agent run; 0 skips")
    parser.add_argument("--no-writes", action="store_true", help="reads only")
    parser.add_argument("--no-load", action="store_true", help="no torch load during writes")
    parser.add_argument(
        "--profile-out",
        type=Path,
        default=None,
        help="sweep clocks with two kernels (torch) and write a fitted planner profile here",
    )
    parser.add_argument(
        "--sweep-seconds", type=float, default=4.0, help="each kernel at each clock (4)"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "daemon"))  # polca, when not installed
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "host": platform.node(),
        "euid": os.geteuid(),
    }
    code = 0
    try:
        run_checks(args, report)
    except Exception as exc:  # the report says what failed, after what
        report["fatal"] = f"{type(exc).__name__}: {exc}"
        code = 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=2, default=str)[:6000])
    print(f"wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
