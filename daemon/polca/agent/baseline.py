"""Save the GPUs' original settings before the first write, and put them back.

The file (``<state_dir>/baseline.json``) is written atomically before polca changes any
GPU. At a clean stop it is removed after the restore; if it is still there at start-up
the previous run died without restoring, so the agent restores from it first and keeps
using it as the baseline (the GPUs' current values are polca's caps, not the originals).
When the policy says ``on_stop: keep``, the caps stay and the file is kept, marked
``kept``: the next start reuses it without a restore.

NVML cannot read back a clock lock, so the baseline records that polca found no lock it
knew of; restoring means resetting the lock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from polca.errors import FatalError
from polca.gpu.backend import GpuInfo, GpuSample

BASELINE_FILE = "baseline.json"


@dataclass(frozen=True, slots=True)
class GpuBaseline:
    """The original settings of one GPU."""

    uuid: str
    index: int
    power_limit_mw: int | None


@dataclass(frozen=True, slots=True)
class Baseline:
    """The original settings of every GPU of the node."""

    gpus: tuple[GpuBaseline, ...]
    saved_ns: int
    kept: bool = False

    def for_uuid(self, uuid: str) -> GpuBaseline | None:
        """The baseline of one GPU, by UUID."""
        return next((g for g in self.gpus if g.uuid == uuid), None)

    @classmethod
    def capture(
        cls, infos: Sequence[GpuInfo], samples: Sequence[GpuSample], *, now_ns: int
    ) -> Baseline:
        """Build a baseline from the GPUs' current (requested) power limits, saved at
        ``now_ns`` (wall clock)."""
        by_index = {s.index: s for s in samples}
        gpus = []
        for info in infos:
            sample = by_index.get(info.index)
            limit = sample.power_limit_mw if sample is not None else None
            gpus.append(GpuBaseline(info.uuid, info.index, limit))
        return cls(tuple(gpus), now_ns)


class BaselineStore:
    """The on-disk baseline file."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / BASELINE_FILE

    def load(self) -> Baseline | None:
        """The saved baseline, or None when there is none (a clean previous stop)."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            msg = f"cannot read saved GPU settings {self.path}: {exc}; inspect or remove it"
            raise FatalError(msg) from exc
        gpus = tuple(GpuBaseline(**g) for g in raw["gpus"])
        return Baseline(gpus, int(raw["saved_ns"]), bool(raw.get("kept", False)))

    def save(self, baseline: Baseline) -> None:
        """Write the baseline atomically (temporary file, fsync, rename)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            with tmp.open("w", encoding="utf-8") as fh:
                json.dump(asdict(baseline), fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            tmp.replace(self.path)
        except OSError as exc:
            msg = (
                f"cannot save original GPU settings to {self.path}: {exc}; set "
                "agent.state_dir (POLCA_AGENT__STATE_DIR) to a writable directory "
                "(systemd: StateDirectory=polca)"
            )
            raise FatalError(msg) from exc

    def remove(self) -> None:
        """Forget the baseline after a complete restore."""
        self.path.unlink(missing_ok=True)
