"""CPU used by a whole ``polca agent`` process at 10 Hz on 8 GPUs (fake NVML, real broker).

The tick benchmark times the sampling call alone; this one measures what an operator sees
in ``top``: the agent process, started as under systemd, sampling 8 GPUs at 10 Hz and
publishing once a second to a local Mosquitto, for ``--seconds`` after a warm-up. CPU time
comes from ``/proc/<pid>/stat`` (user + system). As a floor it measures, in the same run,
an idle Python asyncio process that only sleeps in a 10 Hz loop.

Target: at most 1% of one core. Run from the repository root:

    .venv/bin/python bench/bench_agent_cpu.py [--seconds 30]

It prints a table and writes ``bench/results/agent_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.* is repository tooling (fake NVML, Mosquitto runner)

EXTRA_ENV: dict[str, str] = {}
IDLE_LOOP = (
    "import asyncio\n"
    "async def main():\n"
    "    while True:\n"
    "        await asyncio.sleep(0.1)\n"
    "asyncio.run(main())\n"
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(proc: subprocess.Popen[bytes], warmup_s: float, seconds: float) -> float:
    """Percent of one core used by ``proc`` over ``seconds`` after ``warmup_s``."""
    time.sleep(warmup_s)
    if proc.poll() is not None:
        msg = f"process exited early with {proc.returncode}"
        raise RuntimeError(msg)
    cpu0, wall0 = cpu_seconds(proc.pid), time.monotonic()
    time.sleep(seconds)
    cpu1, wall1 = cpu_seconds(proc.pid), time.monotonic()
    return 100.0 * (cpu1 - cpu0) / (wall1 - wall0)


def run(seconds: float) -> dict[str, Any]:
    """Start broker, fake node and agent; measure the agent and an idle loop."""
    from tests.fake_nvml import FakeNvml
    from tests.mqtt_broker import MosquittoProcess

    with tempfile.TemporaryDirectory(prefix="polca-bench-cpu-") as tmp:
        work = Path(tmp)
        (work / "nvml").mkdir()
        fake = FakeNvml(work / "nvml", gpus=8, model="NVIDIA A100-SXM4-80GB")
        broker = MosquittoProcess(work / "mosquitto")
        broker.start()
        config = {
            "mqtt": {"host": broker.host, "port": broker.port},
            "topics": {"site": "bench", "row": "row1", "rack": "rack1", "node": "node1"},
            "gpu": {"backend": "nvml"},
            "agent": {
                "policy_file": str(REPO / "policies" / "polca-a100.yaml"),
                "state_dir": str(work / "state"),
                "startup_grace_s": 3600,
            },
            "logging": {"level": "warning", "format": "json"},
        }
        (work / "agent.yaml").write_text(yaml.safe_dump(config))
        agent = subprocess.Popen(
            [sys.executable, "-m", "polca", "agent", "--config", str(work / "agent.yaml")],
            env={**fake.env(), **EXTRA_ENV},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        idle = subprocess.Popen([sys.executable, "-c", IDLE_LOOP])
        try:
            agent_pct = measure(agent, 3.0, seconds)
            idle_pct = measure(idle, 0.0, min(seconds, 10.0))
        finally:
            for proc in (agent, idle):
                proc.terminate()
                proc.wait(timeout=20)
            broker.kill()
    return {
        "benchmark": "agent_process_cpu",
        "gpus": 8,
        "sample_hz": 10,
        "seconds": seconds,
        "agent_pct_of_one_core": round(agent_pct, 2),
        "idle_asyncio_loop_pct_of_one_core": round(idle_pct, 2),
        "target_pct": 1.0,
    }


def main() -> int:
    """Run the benchmark, print a table, write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent_cpu.json")
    args = parser.parse_args()
    figures = run(args.seconds)
    print(
        "agent, 8 GPUs at 10 Hz, 1 Hz telemetry:  "
        f"{figures['agent_pct_of_one_core']:6.2f} % of one core"
    )
    print(
        f"idle asyncio loop at 10 Hz (floor):      "
        f"{figures['idle_asyncio_loop_pct_of_one_core']:6.2f} % of one core"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
