"""ThreadedGpu: calls off the loop on one thread, per-call timeouts, draining close."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
from structlog.testing import capture_logs

from polca.errors import GpuLostError, GpuPermissionError, GpuTransientError
from polca.gpu.backend import Capabilities, GpuHealth, GpuInfo, GpuSample
from polca.gpu.simulated import SimulatedBackend
from polca.gpu.threaded import THREAD_NAME_PREFIX, ThreadedGpu


class RecordingBackend:
    """A tiny GpuBackend that records which thread ran each call, and can block."""

    def __init__(self, *, call_s: float = 0.0) -> None:
        self.call_s = call_s
        self.calls: list[tuple[str, str]] = []  # (call, thread name)
        self.release = threading.Event()
        self.release.set()
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def _enter(self, name: str) -> None:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.call_s)
            self.release.wait(timeout=10)
        finally:
            with self._lock:
                self.active -= 1
                self.calls.append((name, threading.current_thread().name))

    def discover(self) -> Sequence[GpuInfo]:
        self._enter("discover")
        return [GpuInfo(index=0, uuid="GPU-0", name="fake", capabilities=Capabilities())]

    def sample(self, index: int) -> GpuSample:
        self._enter(f"sample:{index}")
        return GpuSample(index=index, uuid=f"GPU-{index}", ts_ns=0)

    def health(self, index: int) -> GpuHealth:
        self._enter(f"health:{index}")
        if index == 1:
            msg = "GPU 1 fell off the bus"
            raise GpuLostError(msg, index=1)
        return GpuHealth(index=index, uuid=f"GPU-{index}", xid_errors=0)

    def check_write_access(self) -> None:
        self._enter("check_write_access")

    def set_power_limit_mw(self, index: int, limit_mw: int) -> None:
        self._enter(f"set_power_limit_mw:{index}:{limit_mw}")

    def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
        self._enter(f"lock:{index}:{min_mhz}:{max_mhz}")

    def reset_sm_clocks(self, index: int) -> None:
        self._enter(f"reset:{index}")

    def close(self) -> None:
        self._enter("close")


def gpu_threads() -> list[threading.Thread]:
    """Live worker threads of any ThreadedGpu."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


async def test_constructor_starts_no_thread_and_calls_need_start() -> None:
    """No thread exists before start(); a call before it is a RuntimeError."""
    before = len(gpu_threads())
    gpu = ThreadedGpu(RecordingBackend())
    assert len(gpu_threads()) == before
    with pytest.raises(RuntimeError, match="not started"):
        await gpu.sample(0)


async def test_every_call_runs_on_the_gpu_thread() -> None:
    """Each adapter method runs its backend call on the polca-gpu worker, not the loop."""
    backend = RecordingBackend()
    async with ThreadedGpu(backend) as gpu:
        assert len(await gpu.discover()) == 1
        assert (await gpu.sample(2)).index == 2
        await gpu.sample_all([0, 1])
        await gpu.check_write_access()
        await gpu.set_power_limit_mw(1, 300_000)
        await gpu.lock_sm_clocks_mhz(1, 345, 1305)
        await gpu.reset_sm_clocks(1)
        name = await gpu.run(lambda: threading.current_thread().name)
    assert name.startswith(THREAD_NAME_PREFIX)
    assert [call for call, _ in backend.calls] == [
        "discover",
        "sample:2",
        "sample:0",
        "sample:1",
        "check_write_access",
        "set_power_limit_mw:1:300000",
        "lock:1:345:1305",
        "reset:1",
        "close",
    ]
    threads = {thread for _, thread in backend.calls}
    assert len(threads) == 1
    assert threads.pop().startswith(THREAD_NAME_PREFIX)
    assert threading.current_thread().name not in {t for _, t in backend.calls}


async def test_concurrent_calls_are_serialised() -> None:
    """Calls issued concurrently from many tasks never overlap in the backend."""
    backend = RecordingBackend(call_s=0.005)
    async with ThreadedGpu(backend) as gpu:
        await asyncio.gather(*(gpu.sample(i % 4) for i in range(20)))
    assert backend.max_active == 1
    assert len(backend.calls) == 21  # 20 samples and close


async def test_sample_all_is_one_hop_and_isolates_gpu_errors() -> None:
    """One lost GPU yields its GpuLostError in place; the other GPUs are sampled."""
    backend = SimulatedBackend(count=4, load="constant:0.5")
    backend.lose_gpu(2)
    async with ThreadedGpu(backend) as gpu:
        results = await gpu.sample_all(range(4))
        assert gpu.stats()["calls"] == 1.0
    assert [type(r) for r in results] == [GpuSample, GpuSample, GpuLostError, GpuSample]
    lost = results[2]
    assert isinstance(lost, GpuLostError)
    assert lost.index == 2


async def test_backend_errors_propagate_unchanged() -> None:
    """A GpuPermissionError from the backend reaches the caller as is."""
    backend = SimulatedBackend(count=1, privileged=False)
    async with ThreadedGpu(backend) as gpu:
        with pytest.raises(GpuPermissionError, match="CAP_SYS_ADMIN"):
            await gpu.set_power_limit_mw(0, 300_000)
        with pytest.raises(GpuPermissionError):
            await gpu.check_write_access()


async def test_stuck_call_times_out_as_transient_and_is_logged() -> None:
    """A call blocked past call_timeout_s raises GpuTransientError and logs gpu_call_stuck."""
    backend = RecordingBackend()
    backend.release.clear()
    async with ThreadedGpu(backend, call_timeout_s=0.05) as gpu:
        with capture_logs() as logs:
            started_s = time.perf_counter()
            with pytest.raises(GpuTransientError, match="stuck") as info:
                await gpu.sample(3)
            # At the 0.05 s timeout, not when the driver answers (10 s): seconds of margin
            # for a busy machine.
            assert time.perf_counter() - started_s < 5.0
        assert info.value.index == 3
        assert [e["event"] for e in logs] == ["gpu_call_stuck"]
        assert logs[0]["gpu"] == 3
        assert logs[0]["call"] == "sample"
        assert logs[0]["log_level"] == "error"
        stats = gpu.stats()
        assert stats["timeouts"] == 1.0
        assert stats["latency_max_s"] >= 0.05
        backend.release.set()  # the driver answers again
        assert (await gpu.sample(1)).index == 1


async def test_aclose_drains_calls_in_flight_then_closes_backend() -> None:
    """aclose waits for a running call, closes the backend after it, then ends the thread."""
    backend = RecordingBackend()
    backend.release.clear()
    gpu = ThreadedGpu(backend)
    await gpu.start()
    in_flight = asyncio.ensure_future(gpu.sample(5))
    await asyncio.sleep(0.02)  # let the call reach the worker
    closing = asyncio.ensure_future(gpu.aclose())
    await asyncio.sleep(0.02)
    assert not closing.done()
    backend.release.set()
    await closing
    assert (await in_flight).index == 5
    assert [call for call, _ in backend.calls] == ["sample:5", "close"]
    assert not gpu_threads()
    with pytest.raises(RuntimeError, match="closed"):
        await gpu.sample(0)
    await gpu.aclose()  # idempotent
    with pytest.raises(RuntimeError, match="restarted"):
        await gpu.start()


async def test_aclose_gives_up_on_a_stuck_driver() -> None:
    """A call stuck beyond close_timeout_s makes aclose log gpu_close_stuck and return."""
    backend = RecordingBackend()
    backend.release.clear()
    gpu = ThreadedGpu(backend, call_timeout_s=0.02, close_timeout_s=0.05)
    await gpu.start()
    with pytest.raises(GpuTransientError):
        await gpu.sample(0)
    with capture_logs() as logs:
        await gpu.aclose()
    assert [e["event"] for e in logs] == ["gpu_close_stuck"]
    backend.release.set()
    for _ in range(1000):  # the abandoned worker ends once the driver answers (<= 10 s)
        if not gpu_threads():
            break
        await asyncio.sleep(0.01)
    assert not gpu_threads()
    assert "close" not in [call for call, _ in backend.calls]  # cancelled while queued


async def test_stats_track_latency() -> None:
    """stats() counts calls and reports last, max and p99 latency consistently."""
    backend = RecordingBackend(call_s=0.002)
    async with ThreadedGpu(backend, latency_window=16) as gpu:
        assert gpu.stats()["calls"] == 0.0
        for i in range(30):
            await gpu.sample(i)
        stats = gpu.stats()
    assert stats["calls"] == 30.0
    assert stats["timeouts"] == 0.0
    assert 0.002 <= stats["latency_last_s"] <= stats["latency_max_s"]
    assert 0.002 <= stats["latency_p99_s"] <= stats["latency_max_s"]


async def test_run_passes_arguments() -> None:
    """run() forwards positional and keyword arguments to the callable."""
    async with ThreadedGpu(RecordingBackend()) as gpu:
        assert await gpu.run(divmod, 17, 5) == (3, 2)
        assert await gpu.run(int, "ff", base=16) == 255


def test_timeouts_must_be_positive() -> None:
    """A zero timeout is rejected at construction."""
    with pytest.raises(ValueError, match="positive"):
        ThreadedGpu(RecordingBackend(), call_timeout_s=0)


async def test_health_all_reads_on_the_worker_and_counts_errors() -> None:
    """health_all is one hop to the GPU thread; a GPU's failure is its result and counted."""
    backend = RecordingBackend()
    async with ThreadedGpu(backend) as gpu:
        results = await gpu.health_all([0, 1, 2])
        assert isinstance(results[0], GpuHealth)
        assert isinstance(results[1], GpuLostError)
        assert isinstance(results[2], GpuHealth)
        assert gpu.stats()["errors"] == 1
        assert {t for c, t in backend.calls if c.startswith("health")} == {
            t for _, t in backend.calls
        }
        assert all(t.startswith(THREAD_NAME_PREFIX) for _, t in backend.calls)
