"""The locks in requirements/ (requirements/README.md) and the scripts that install them.

Checked statically against pyproject.toml: every lock pins exact releases with hashes, the
test lock satisfies every declared range, the runtime, demo and simulator locks agree with
it, and every script, the Dockerfile and the README's install lines install from a lock.
``scripts/locks.py`` (what the refresh prints) is tested on its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
ALL_LOCKS = ("test", "runtime", "demo", "sim", "snmpsim", "lock-tools")
# Each of polca's locks and the extras of pyproject.toml it is made from.
POLCA_LOCKS = {"test": ("test",), "runtime": (), "demo": ("embedded",), "sim": ("sim",)}
BUILD = ("pip", "setuptools", "wheel")


def _entries(lock: str) -> list[tuple[Requirement, list[str]]]:
    """Each requirement of a lock with its hashes."""
    entries: list[tuple[Requirement, list[str]]] = []
    for line in (LOCKS / f"{lock}.txt").read_text(encoding="utf-8").splitlines():
        stripped = line.strip().removesuffix("\\").strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("--hash="):
            assert entries, f"{lock}: a hash before any requirement"
            entries[-1][1].append(stripped.removeprefix("--hash="))
        else:
            assert not line.startswith(" "), f"{lock}: unexpected line {line!r}"
            entries.append((Requirement(stripped), []))
    return entries


def _pins(lock: str) -> dict[str, Version]:
    """``name -> release`` for this machine's environment (markers evaluated)."""
    env: dict[str, str] = {key: str(value) for key, value in default_environment().items()}
    pins: dict[str, Version] = {}
    for req, _ in _entries(lock):
        if req.marker is None or req.marker.evaluate(env):
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


@pytest.mark.parametrize("lock", ALL_LOCKS)
def test_every_entry_is_an_exact_release_with_its_hashes(lock: str) -> None:
    """``name==X`` and at least one sha256 per entry: pip's hash-checking mode refuses any
    file the lock does not name."""
    entries = _entries(lock)
    assert entries
    for req, hashes in entries:
        specs = list(req.specifier)
        assert len(specs) == 1, req
        assert specs[0].operator == "==", req
        assert "*" not in specs[0].version, req
        assert hashes, f"{lock}: {req} has no hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), req


@pytest.mark.parametrize(("lock", "extras"), POLCA_LOCKS.items())
def test_each_lock_holds_what_pyproject_declares_within_its_ranges(
    lock: str, extras: tuple[str, ...]
) -> None:
    """Every dependency of pyproject.toml (and of the lock's extras) is pinned, at a release
    its declared range allows, with pip and the build backend: a dependency added to
    pyproject.toml without ./scripts/lock.sh fails here."""
    pins = _pins(lock)
    declared = list(PROJECT["dependencies"])
    for extra in extras:
        declared += PROJECT["optional-dependencies"][extra]
    build_system = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    declared += build_system["build-system"]["requires"]
    for text in declared:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock}.txt has no {name}: run ./scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{lock}.txt pins {name} {pins[name]}, outside {req}: run ./scripts/lock.sh"
        )
    for build in BUILD:
        assert build in pins, f"{lock}.txt has no {build}"


@pytest.mark.parametrize("lock", ["runtime", "demo", "sim"])
def test_a_package_has_one_release_in_every_polca_lock(lock: str) -> None:
    """The runtime, demo and simulator locks are resolved under the test lock: what the tests
    ran is what an operator or a first-time user installs."""
    test_pins = _pins("test")
    for name, version in _pins(lock).items():
        assert test_pins.get(name) == version, (
            f"{lock}.txt {name} {version}, test.txt {test_pins.get(name)}"
        )


def test_the_test_venv_is_the_lock() -> None:
    """This very run: every package of the test lock is installed at its locked release (a
    run under scripts/newest.sh is the one exception, on purpose)."""
    if "newest-venv" in sys.prefix:
        assert (Path(sys.prefix) / "newest-pins.txt").is_file()
        return
    installed: dict[str, Version] = {
        canonicalize_name(line.split("==")[0]): Version(line.split("==")[1])
        for line in subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        if "==" in line
    }
    for name, version in _pins("test").items():
        assert installed.get(name) == version, (
            f"{name}: installed {installed.get(name)}, locked {version}"
        )


SCRIPTS = ROOT / "scripts"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_every_script_that_makes_a_venv_installs_a_lock(script: str) -> None:
    """A script that creates a venv installs into it only hash-checked from a lock (pip's
    --require-hashes, or ensure_venv with a lock), and polca itself with --no-deps; newest.sh
    and floors.sh resolve on purpose (the newest and the lowest releases the ranges allow)."""
    text = (SCRIPTS / script).read_text(encoding="utf-8")
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    if "-m venv" not in code and "ensure_venv" not in code:
        return
    if script in {"newest.sh", "floors.sh"}:
        assert "newest" in text if script == "newest.sh" else "floor" in text
        return
    installs = re.findall(r"pip install[^\n]*", code)
    for install in installs:
        assert "--require-hashes" in install or "--no-deps" in install, f"{script}: {install}"
    assert installs or "ensure_venv requirements/" in code, script


@pytest.mark.parametrize("doc", ["README.md", "deploy/README.md"])
def test_the_operators_install_lines_use_the_runtime_lock(doc: str) -> None:
    """Every ``/opt/polca`` pip line in the install docs is the lock's or polca's own
    (--no-deps): an operator's node runs the releases the tests ran."""
    lines = [
        line.strip()
        for line in (ROOT / doc).read_text(encoding="utf-8").splitlines()
        if "/opt/polca/bin/pip install" in line
    ]
    assert lines, doc
    for line in lines:
        assert (
            "--require-hashes -r requirements/runtime.txt" in line
            or "--no-deps --no-build-isolation" in line
        ), f"{doc}: {line}"
    assert any("--require-hashes -r requirements/runtime.txt" in line for line in lines), doc


def _locks_py(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "locks.py"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_locks_diff_says_what_changed(tmp_path: Path) -> None:
    """Changed, added and removed packages, names normalised, hashes and markers ignored."""
    old = tmp_path / "old.txt"
    new = tmp_path / "new.txt"
    old.write_text(
        "aiohttp==3.9.0 \\\n    --hash=sha256:" + "a" * 64 + "\nPyYAML==6.0.1\nsix==1.16.0\n",
        encoding="utf-8",
    )
    new.write_text(
        "aiohttp==3.14.5 ; python_version >= '3.11' \\\n    --hash=sha256:"
        + "b" * 64
        + "\npyyaml==6.0.1\nnumpy==2.4.6 ; python_version < '3.12'\n"
        + "numpy==2.5.5 ; python_version >= '3.12'\n",
        encoding="utf-8",
    )
    done = _locks_py("diff", "--label", "test", str(old), str(new))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "test: aiohttp 3.9.0 -> 3.14.5",
        "test: + numpy 2.4.6|2.5.5",
        "test: - six 1.16.0",
    ]
    same = _locks_py("diff", str(new), str(new))
    assert same.stdout.strip() == "no change"


def test_locks_pick_gives_a_lock_of_the_named_entries() -> None:
    """The named entries with every hash line; a name the lock lacks is an error."""
    done = _locks_py("pick", str(LOCKS / "test.txt"), "pip", "Wheel")
    assert done.returncode == 0, done.stderr
    names = [line.split("==")[0] for line in done.stdout.splitlines() if "==" in line]
    assert names == ["pip", "wheel"]
    assert done.stdout.count("--hash=sha256:") >= 2
    assert "# via" not in done.stdout
    missing = _locks_py("pick", str(LOCKS / "test.txt"), "pip", "no-such-package")
    assert missing.returncode == 1
    assert "no entry for no-such-package" in missing.stderr


def test_locks_diff_here_leaves_out_entries_for_other_environments(tmp_path: Path) -> None:
    """--here evaluates each entry's marker for this interpreter: a universal lock's entries
    for Windows or another Python are not changes against this machine's freeze."""
    lock = tmp_path / "lock.txt"
    lock.write_text(
        "colorama==0.4.6 ; sys_platform == 'win32' \\\n    --hash=sha256:" + "a" * 64 + "\n"
        "numpy==2.4.6 ; python_full_version < '3.99'\n"
        "numpy==9.9.9 ; python_full_version >= '3.99'\n",
        encoding="utf-8",
    )
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.4.6\n", encoding="utf-8")
    plain = _locks_py("diff", str(lock), str(freeze))
    assert "- colorama 0.4.6" in plain.stdout
    here = _locks_py("diff", "--here", str(lock), str(freeze))
    assert here.returncode == 0, here.stderr
    assert here.stdout.strip() == "no change"
