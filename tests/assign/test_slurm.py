"""deploy/slurm's Prolog and Epilog under bash, with Slurm's variables and a stand-in
``polca`` on PATH that records its arguments (the scripts are what is tested here; the
command itself is tested against a real broker in test_cli.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROLOG = ROOT / "deploy" / "slurm" / "prolog.sh"
EPILOG = ROOT / "deploy" / "slurm" / "epilog.sh"
UUID = "GPU-5d2b7c1e-0a7f-4e0c-9a51-0c3c2d1b9f00"

STUB = """#!/bin/sh
printf '%s\\n' "$@" > "$POLCA_STUB_LOG"
echo "polca assign: node n1 not found (stand-in)" >&2
exit "${POLCA_STUB_EXIT:-0}"
"""


def _host() -> str:
    done = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _run(
    script: Path, tmp_path: Path, *, exit_code: int = 0, **slurm: str
) -> tuple[subprocess.CompletedProcess[str], list[str] | None]:
    """Run ``script`` with ``slurm`` as its environment; its result and polca's argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "polca"
    stub.write_text(STUB, encoding="utf-8")
    stub.chmod(0o755)
    record = tmp_path / "argv"
    record.unlink(missing_ok=True)
    bash = shutil.which("bash")
    assert bash is not None
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "POLCA_STUB_LOG": str(record),
        "POLCA_STUB_EXIT": str(exit_code),
        "POLCA_ASSIGN_CONFIG": str(tmp_path / "absent.yaml"),
        **slurm,
    }
    done = subprocess.run(
        [bash, str(script)], capture_output=True, text=True, timeout=30, check=False, env=env
    )
    argv = record.read_text(encoding="utf-8").splitlines() if record.exists() else None
    return done, argv


def test_the_prolog_assigns_the_jobs_gpus_the_partitions_class(tmp_path: Path) -> None:
    """SLURM_JOB_GPUS (ranges expanded) with the partition's class, on this host's node."""
    done, argv = _run(
        PROLOG, tmp_path, SLURM_JOB_ID="42", SLURM_JOB_GPUS="0,2-3", SLURM_JOB_PARTITION="inference"
    )
    assert done.returncode == 0, done.stderr
    assert argv == [
        *("assign", "--node", _host()),
        *("--gpu", "0", "--gpu", "2", "--gpu", "3"),
        *("--class", "high", "--timeout", "5"),
    ]


def test_the_qos_wins_and_uuids_from_cuda_visible_devices_pass(tmp_path: Path) -> None:
    """Without SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES names the GPUs; the QOS's class wins
    over the partition's; the settings file is passed when it exists."""
    config = tmp_path / "assign.yaml"
    config.write_text("site: dc1\n", encoding="utf-8")
    done, argv = _run(
        PROLOG,
        tmp_path,
        CUDA_VISIBLE_DEVICES=f"{UUID},1",
        SLURM_JOB_QOS="scavenger",
        SLURM_JOB_PARTITION="inference",
        POLCA_ASSIGN_CONFIG=str(config),
        POLCA_NODE="node7",
    )
    assert done.returncode == 0, done.stderr
    assert argv == [
        *("assign", "--node", "node7", "--gpu", UUID, "--gpu", "1"),
        *("--class", "low", "--timeout", "5", "--config", str(config)),
    ]


@pytest.mark.parametrize("code", [1, 69, 77, 78])
def test_a_failing_polca_never_fails_the_prolog_or_epilog(tmp_path: Path, code: int) -> None:
    """polca assign failing: both scripts exit 0 and log its reason."""
    for script in (PROLOG, EPILOG):
        done, argv = _run(script, tmp_path, exit_code=code, SLURM_JOB_ID="42", SLURM_JOB_GPUS="1")
        assert argv is not None  # it was called...
        assert done.returncode == 0  # ...and its failure did not fail the job
        assert f"failed (exit {code})" in done.stderr
        assert "not found (stand-in)" in done.stderr


def test_a_missing_polca_never_fails_the_prolog(tmp_path: Path) -> None:
    """No polca at all (not installed on this node): still exit 0, logged."""
    done, _ = _run(PROLOG, tmp_path, SLURM_JOB_GPUS="0", POLCA=str(tmp_path / "nowhere"))
    assert done.returncode == 0
    assert "polca assign failed" in done.stderr


def test_the_epilog_clears_only_the_jobs_gpus(tmp_path: Path) -> None:
    done, argv = _run(EPILOG, tmp_path, SLURM_JOB_ID="42", SLURM_JOB_GPUS="4,5")
    assert done.returncode == 0, done.stderr
    assert argv == [
        *("assign", "--node", _host(), "--gpu", "4", "--gpu", "5"),
        *("--clear", "--timeout", "5"),
    ]


@pytest.mark.parametrize("script", [PROLOG, EPILOG])
def test_a_job_without_gpus_calls_nothing(tmp_path: Path, script: Path) -> None:
    """No GPU named (or only NoDevFiles): polca is not called; the Epilog never clears the
    whole node."""
    for visible in ("", "NoDevFiles"):
        done, argv = _run(
            script, tmp_path, SLURM_JOB_PARTITION="inference", CUDA_VISIBLE_DEVICES=visible
        )
        assert done.returncode == 0, done.stderr
        assert argv is None


def test_a_job_matching_no_class_is_left_alone_without_a_default(tmp_path: Path) -> None:
    done, argv = _run(
        PROLOG, tmp_path, SLURM_JOB_GPUS="0", SLURM_JOB_PARTITION="debug", POLCA_DEFAULT_CLASS=""
    )
    assert done.returncode == 0
    assert argv is None
    assert "no class" in done.stderr
    _, with_default = _run(PROLOG, tmp_path, SLURM_JOB_GPUS="0", SLURM_JOB_PARTITION="debug")
    assert with_default is not None
    assert with_default[with_default.index("--class") + 1] == "normal"
