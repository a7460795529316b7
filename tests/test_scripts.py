"""The setup scripts (``scripts/demo.sh``, ``scripts/test.sh``) install a lock and recover
from a broken ``.venv``: their shared ``ensure_venv`` (``scripts/venv.sh``) installs exactly
the lock's releases, hash-checked, rebuilds a venv an interrupted setup left without pip, or
one polca cannot be imported from. Run on a stand-in project (a one-file package named
``polca``) whose lock is the real test lock's pip, setuptools and wheel, so that the test
installs nothing big."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "test.txt"
# pip and the build backend, with what they need (hash-checking refuses an unpinned need).
BUILD = ("pip", "setuptools", "wheel", "packaging")


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "venv.sh", project / "scripts" / "venv.sh")
    (project / "src" / "polca").mkdir(parents=True)
    (project / "src" / "polca" / "__init__.py").write_text("VERSION = 1\n", encoding="utf-8")
    picked = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "locks.py"), "pick", str(LOCK), *BUILD],
        capture_output=True,
        text=True,
        check=True,
    )
    (project / "requirements").mkdir()
    (project / "requirements" / "lock.txt").write_text(picked.stdout, encoding="utf-8")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "polca"\nversion = "0"\n'
        '[tool.setuptools.packages.find]\nwhere = ["src"]\n',
        encoding="utf-8",
    )
    return project


def _ensure(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", ". scripts/venv.sh && ensure_venv requirements/lock.txt"],
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


def _installed(project: Path, name: str) -> str:
    done = subprocess.run(
        [project / ".venv" / "bin" / "python", "-m", "pip", "show", name],
        capture_output=True,
        text=True,
        check=True,
    )
    return next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("Version:"))


def _locked(name: str) -> str:
    text = (ROOT / "requirements" / "test.txt").read_text(encoding="utf-8")
    match = re.search(rf"(?m)^{name}==(\S+)", text)
    assert match is not None, name
    return match.group(1)


def test_the_venv_holds_the_locks_releases_even_over_others(tmp_path: Path) -> None:
    """A venv with other releases (an earlier lock's) is brought to the lock's: pip and the
    build backend are the lock's after ensure_venv, not the interpreter's bundled ones."""
    project = _project(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", ".venv"], cwd=project, check=True)
    subprocess.run(
        [project / ".venv" / "bin" / "python", "-m", "pip", "install", "--quiet", "wheel==0.45.1"],
        check=True,
    )
    assert _installed(project, "wheel") == "0.45.1"
    done = _ensure(project)
    assert done.returncode == 0, done.stderr
    for name in BUILD:
        assert _installed(project, name) == _locked(name)


def test_a_file_whose_hash_the_lock_does_not_name_is_refused(tmp_path: Path) -> None:
    """Hash checking is on: a lock whose wheel hash is wrong fails the setup, twice (once in
    the venv as found, once rebuilt), saying so; nothing unverified is installed."""
    project = _project(tmp_path)
    lock = project / "requirements" / "lock.txt"
    text = lock.read_text(encoding="utf-8")
    lock.write_text(re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, text), encoding="utf-8")
    done = _ensure(project)
    assert done.returncode != 0
    assert "HASHES" in done.stderr
    assert "rebuilding it" in done.stderr
