"""The setup scripts (``scripts/demo.sh``, ``scripts/test.sh``) recover from a broken
``.venv``: their shared ``ensure_venv`` (``scripts/venv.sh``) rebuilds a venv an interrupted
setup left without pip, or one polca cannot be imported from. Run on a stand-in project (a
one-file package named ``polca``) so that the test installs nothing big."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "venv.sh", project / "scripts" / "venv.sh")
    (project / "src" / "polca").mkdir(parents=True)
    (project / "src" / "polca" / "__init__.py").write_text("VERSION = 1\n", encoding="utf-8")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "polca"\nversion = "0"\n'
        '[tool.setuptools.packages.find]\nwhere = ["src"]\n',
        encoding="utf-8",
    )
    return project


def _ensure(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", ". scripts/venv.sh && ensure_venv ."],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_a_venv_left_without_pip_is_rebuilt(tmp_path: Path) -> None:
    """A venv made without pip (a setup cut short): said on stderr, rebuilt, polca imports."""
    project = _project(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", ".venv"], cwd=project, check=True
    )
    done = _ensure(project)
    assert done.returncode == 0, done.stderr
    assert "rebuilding it" in done.stderr
    check = subprocess.run(
        [project / ".venv" / "bin" / "python", "-c", "import polca; print(polca.VERSION)"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.stdout.strip() == "1", check.stderr
    again = _ensure(project)  # a working venv is kept as it is
    assert again.returncode == 0, again.stderr
    assert "rebuilding" not in again.stderr


def test_a_venv_whose_python_is_gone_is_rebuilt(tmp_path: Path) -> None:
    """A .venv directory without its interpreter (removed, or a copy from another host)."""
    project = _project(tmp_path)
    (project / ".venv" / "bin").mkdir(parents=True)
    done = _ensure(project)
    assert done.returncode == 0, done.stderr
    assert "rebuilding it" in done.stderr
    assert (project / ".venv" / "bin" / "python").exists()
