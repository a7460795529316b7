"""The single async adapter over a synchronous ``GpuBackend``.

NVML calls block in the driver, sometimes for a long time, and the driver is happiest
with one caller at a time. ``ThreadedGpu`` therefore runs every backend call on one
dedicated worker thread (``polca-gpu``), never on the event loop, and bounds how long the
loop waits for each call. A call that overruns is reported as ``GpuTransientError`` and
logged as ``gpu_call_stuck``; it keeps running on the worker, and later calls queue behind
it, so a hung driver shows up as a stream of timeouts rather than as a frozen daemon.

Nothing here knows about NVML or the simulator: this module must stay backend-agnostic
and must not start threads before ``start()`` (or ``async with``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

import structlog

from polca.errors import GpuError, GpuTransientError
from polca.gpu.backend import (
    GpuBackend,
    GpuHealth,
    GpuInfo,
    GpuSample,
    GpuWrite,
    WriteResult,
    execute_writes,
)

P = ParamSpec("P")
T = TypeVar("T")

THREAD_NAME_PREFIX = "polca-gpu"

_log = structlog.get_logger()


class ThreadedGpu:
    """Async access to a ``GpuBackend``, one worker thread, a timeout on every call.

    Use as ``async with ThreadedGpu(backend) as gpu: ...`` or ``await start()`` then
    ``await aclose()``. Calls made before ``start()`` or after ``aclose()`` raise
    ``RuntimeError`` (a lifecycle bug, not a GPU failure).
    """

    def __init__(
        self,
        backend: GpuBackend,
        *,
        call_timeout_s: float = 2.0,
        discover_timeout_s: float = 30.0,
        close_timeout_s: float = 10.0,
        latency_window: int = 256,
    ) -> None:
        """Wrap ``backend``; no thread starts until ``start()``.

        ``discover_timeout_s`` is separate because opening NVML on a node without
        persistence mode can take seconds. ``close_timeout_s`` bounds ``aclose()``: draining
        the calls in flight plus the backend's ``close()``. ``latency_window`` is the number
        of recent call latencies kept for the p99 in ``stats()``.
        """
        if call_timeout_s <= 0 or discover_timeout_s <= 0 or close_timeout_s <= 0:
            msg = "ThreadedGpu timeouts must be positive"
            raise ValueError(msg)
        self._backend = backend
        self._call_timeout_s = call_timeout_s
        self._discover_timeout_s = discover_timeout_s
        self._close_timeout_s = close_timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        # Latencies are recorded on the event-loop thread only: no lock needed.
        self._latencies_s: deque[float] = deque(maxlen=latency_window)
        self._calls = 0
        self._timeouts = 0
        self._errors = 0
        self._last_s = 0.0
        self._max_s = 0.0

    @property
    def backend(self) -> GpuBackend:
        """The wrapped backend (for fault injection in tests; never call it directly)."""
        return self._backend

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Create the worker thread's executor; idempotent until ``aclose()``."""
        if self._closed:
            msg = "ThreadedGpu cannot be restarted after aclose()"
            raise RuntimeError(msg)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX
            )

    async def __aenter__(self) -> Self:
        """Start and return self."""
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close, as ``aclose()``."""
        await self.aclose()

    async def aclose(self) -> None:
        """Drain the calls in flight, close the backend on the worker, stop the thread.

        The worker runs calls in order, so ``backend.close()`` queued last runs after every
        call already submitted. If that does not finish within ``close_timeout_s`` (a call
        is stuck in the driver), the executor is abandoned: its thread ends when the call
        returns, or with the process. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is None:
            return
        future = executor.submit(self._backend.close)
        try:
            async with asyncio.timeout(self._close_timeout_s):
                await asyncio.wrap_future(future)
        except TimeoutError:
            _log.error("gpu_close_stuck", timeout_s=self._close_timeout_s)
            executor.shutdown(wait=False, cancel_futures=True)
        except BaseException:
            # backend.close() failed or we were cancelled: still release the thread.
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        else:
            # The worker is idle now, so joining it returns at once.
            executor.shutdown(wait=True)

    # --- calls ---------------------------------------------------------------------------

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run any synchronous callable on the GPU thread, bounded by ``call_timeout_s``."""
        return await self._call(fn, args, kwargs, timeout_s=self._call_timeout_s, index=None)

    async def discover(self) -> tuple[GpuInfo, ...]:
        """Enumerate the GPUs (bounded by ``discover_timeout_s``)."""
        infos = await self._call(
            self._backend.discover, (), {}, timeout_s=self._discover_timeout_s, index=None
        )
        return tuple(infos)

    async def sample_all(self, indices: Sequence[int]) -> list[GpuSample | GpuError]:
        """Sample GPUs ``indices`` in one hop to the worker; a failed GPU gives its error."""
        results = await self._call(
            self._many,
            (self._backend.sample, tuple(indices)),
            {},
            timeout_s=self._call_timeout_s,
            index=None,
        )
        self._errors += sum(1 for r in results if isinstance(r, GpuError))
        return results

    async def health_all(self, indices: Sequence[int]) -> list[GpuHealth | GpuError]:
        """Read the health counters of GPUs ``indices`` in one hop to the worker."""
        results = await self._call(
            self._many,
            (self._backend.health, tuple(indices)),
            {},
            timeout_s=self._call_timeout_s,
            index=None,
        )
        self._errors += sum(1 for r in results if isinstance(r, GpuError))
        return results

    async def sample(self, index: int) -> GpuSample:
        """Sample one GPU."""
        return await self._call(
            self._backend.sample, (index,), {}, timeout_s=self._call_timeout_s, index=index
        )

    async def check_write_access(self) -> None:
        """Raise ``GpuPermissionError`` unless the backend may write."""
        await self._call(
            self._backend.check_write_access, (), {}, timeout_s=self._call_timeout_s, index=None
        )

    async def set_power_limit_mw(self, index: int, limit_mw: int) -> None:
        """Set the power limit of GPU ``index``."""
        await self._call(
            self._backend.set_power_limit_mw,
            (index, limit_mw),
            {},
            timeout_s=self._call_timeout_s,
            index=index,
        )

    async def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock range of GPU ``index``."""
        await self._call(
            self._backend.lock_sm_clocks_mhz,
            (index, min_mhz, max_mhz),
            {},
            timeout_s=self._call_timeout_s,
            index=index,
        )

    async def reset_sm_clocks(self, index: int) -> None:
        """Remove the SM clock lock of GPU ``index``."""
        await self._call(
            self._backend.reset_sm_clocks, (index,), {}, timeout_s=self._call_timeout_s, index=index
        )

    async def write(self, batches: Sequence[Sequence[GpuWrite]]) -> list[list[WriteResult]]:
        """Execute each GPU's writes in order, in one hop to the worker; results as data.

        A batch is one GPU's writes: a failing write ends its batch (the GPU is left as
        the earlier writes made it) and the other batches carry on. After a
        ``SetPowerLimit`` the GPU is sampled, so the caller can check what the driver
        enforces. The wait is bounded by ``call_timeout_s`` per write; past it every batch
        is reported failed with ``GpuTransientError`` (the calls finish on the worker).
        """
        count = sum(len(batch) for batch in batches)
        if count == 0:
            return [[] for _ in batches]
        frozen = tuple(tuple(batch) for batch in batches)
        try:
            results = await self._call(
                execute_writes,
                (self._backend, frozen),
                {},
                timeout_s=self._call_timeout_s * count,
                index=None,
            )
        except GpuTransientError as exc:
            return [[WriteResult(batch[0], exc)] if batch else [] for batch in frozen]
        self._errors += sum(1 for batch in results for r in batch if r.error is not None)
        return results

    # --- health --------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Call latency as the event loop sees it (queueing included), for health telemetry.

        Keys: ``calls``, ``timeouts``, ``errors`` (calls, samples, health reads and
        writes that failed, timeouts included), ``latency_last_s``, ``latency_max_s``, and
        ``latency_p99_s`` over the last ``latency_window`` calls.
        """
        recent = sorted(self._latencies_s)
        p99_s = recent[math.ceil(0.99 * len(recent)) - 1] if recent else 0.0
        return {
            "calls": float(self._calls),
            "timeouts": float(self._timeouts),
            "errors": float(self._errors),
            "latency_last_s": self._last_s,
            "latency_max_s": self._max_s,
            "latency_p99_s": p99_s,
        }

    # --- internals -----------------------------------------------------------------------

    @staticmethod
    def _many(read: Callable[[int], T], indices: tuple[int, ...]) -> list[T | GpuError]:
        """Runs on the worker: one GPU's error must not hide the others' readings."""
        results: list[T | GpuError] = []
        for index in indices:
            try:
                results.append(read(index))
            except GpuError as exc:
                results.append(exc)
        return results

    async def _call(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        timeout_s: float,
        index: int | None,
    ) -> T:
        executor = self._executor
        if executor is None:
            state = "closed" if self._closed else "not started"
            msg = f"ThreadedGpu is {state}: use 'async with ThreadedGpu(...)' or start()"
            raise RuntimeError(msg)
        future: Future[T] = executor.submit(fn, *args, **kwargs)
        started_s = time.perf_counter()
        try:
            # The timeout cancels the wrapper; that cancels a queued call, while a running
            # one cannot be interrupted and finishes on the worker unobserved. Not
            # asyncio.wait_for: on Python 3.11 it can swallow a cancellation that races
            # with the result (CPython gh-86296), which would hang the supervisor's stop.
            async with asyncio.timeout(timeout_s):
                return await asyncio.wrap_future(future)
        except GpuError:
            self._errors += 1
            raise
        except TimeoutError as exc:
            self._timeouts += 1
            self._errors += 1
            name = getattr(fn, "__name__", repr(fn))
            _log.error("gpu_call_stuck", call=name, gpu=index, timeout_s=timeout_s)
            msg = (
                f"GPU call {name} (gpu {index}) is stuck: no answer within {timeout_s} s; "
                "later calls queue behind it on the GPU thread"
            )
            raise GpuTransientError(msg, index=index, delay_s=timeout_s) from exc
        finally:
            self._record(time.perf_counter() - started_s)

    def _record(self, latency_s: float) -> None:
        self._calls += 1
        self._last_s = latency_s
        self._max_s = max(self._max_s, latency_s)
        self._latencies_s.append(latency_s)
