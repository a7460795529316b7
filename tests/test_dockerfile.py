"""The Dockerfile and .dockerignore, checked statically (no container engine in CI).

Two stages on the same slim Python image, only the package sources in the build context,
and the same entry point and arguments as the systemd unit.
"""

from __future__ import annotations

import json
import re
import shlex
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
UNIT = ROOT / "systemd" / "polca-agent.service"

Instruction = tuple[str, str]


def _instructions(text: str) -> list[Instruction]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    result: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        result.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "dangling continuation line"
    return result


def _stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    stages: list[list[Instruction]] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            stages.append([])
        assert stages, f"{keyword} before the first FROM"
        stages[-1].append((keyword, args))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions, one list per stage, each starting with its FROM."""
    return _stages(_instructions(DOCKERFILE.read_text(encoding="utf-8")))


def _args(stage: list[Instruction], keyword: str) -> list[str]:
    return [args for kw, args in stage if kw == keyword]


def _env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _args(stage, "ENV"):
        for pair in shlex.split(args):
            key, sep, value = pair.partition("=")
            assert sep, f"use ENV KEY=value, not the legacy form: {args!r}"
            env[key] = value
    return env


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or a parent decides; '!' re-includes."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        cleaned = pattern.removeprefix("!").strip("/")
        variants = {cleaned, cleaned.removeprefix("**/")}
        if any(fnmatchcase(c, v) for c in candidates for v in variants):
            ignored = not negated
    return ignored


def test_two_stages_on_the_same_slim_python(stages: list[list[Instruction]]) -> None:
    """A builder and a runtime stage, both python:3.11-slim (the venv links to its python)."""
    froms = [stage[0][1].split() for stage in stages]
    assert froms == [
        ["python:3.11-slim", "AS", "builder"],
        ["python:3.11-slim", "AS", "runtime"],
    ]


def test_no_cuda_base_image() -> None:
    """No CUDA or NVIDIA base image: the container toolkit injects NVML from the host."""
    for keyword, args in _instructions(DOCKERFILE.read_text(encoding="utf-8")):
        if keyword == "FROM":
            assert not re.search(r"cuda|nvidia", args, re.IGNORECASE), args


def test_builder_copies_only_package_sources(stages: list[list[Instruction]]) -> None:
    """The builder copies pyproject.toml, README.md, daemon/ and the runtime lock, installs
    the lock's exact releases hash-checked, then polca without resolving anything again."""
    builder = stages[0]
    sources = [src for args in _args(builder, "COPY") for src in args.split()[:-1]]
    assert sorted(sources) == ["README.md", "daemon/", "pyproject.toml", "requirements/runtime.txt"]
    for source in sources:
        assert (ROOT / source).exists(), source
    runs = [step.strip() for args in _args(builder, "RUN") for step in args.split("&&")]
    assert "python -m venv /opt/polca" in runs
    locked = runs.index("/opt/polca/bin/pip install --require-hashes -r requirements/runtime.txt")
    polca = runs.index("/opt/polca/bin/pip install --no-deps --no-build-isolation .")
    assert locked < polca
    # No other pip install: each would resolve outside the lock.
    assert sum("pip install" in step for step in runs) == 2


def test_runtime_copies_only_the_venv(stages: list[list[Instruction]]) -> None:
    """The runtime takes /opt/polca from the builder and, from the build context, only the
    licence (Apache-2.0 goes with every copy of the software)."""
    runtime = stages[1]
    assert _args(runtime, "COPY") == [
        "--from=builder /opt/polca /opt/polca",
        "LICENSE /usr/share/doc/polca/LICENSE",
    ]
    assert (ROOT / "LICENSE").is_file()
    assert not any("pip install" in args for args in _args(runtime, "RUN"))


def test_runtime_environment(stages: list[list[Instruction]]) -> None:
    """NVML via the NVIDIA runtime, unbuffered logs, the state directory and its volume."""
    runtime = stages[1]
    env = _env(runtime)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["STATE_DIRECTORY"] == "/var/lib/polca"
    assert _args(runtime, "VOLUME") == [env["STATE_DIRECTORY"]]


def test_entrypoint_matches_systemd_unit(stages: list[list[Instruction]]) -> None:
    """ENTRYPOINT + CMD (exec form) run the same command line as the unit's ExecStart=."""
    runtime = stages[1]
    (entrypoint,) = _args(runtime, "ENTRYPOINT")
    (cmd,) = _args(runtime, "CMD")
    argv = json.loads(entrypoint) + json.loads(cmd)
    assert argv[0] == "/opt/polca/bin/polca"
    exec_start = re.search(r"(?m)^ExecStart=(.*)$", UNIT.read_text(encoding="utf-8"))
    assert exec_start is not None
    assert argv == exec_start.group(1).split()


def test_capability_hints_documented() -> None:
    """The Dockerfile says how to run with SYS_ADMIN and GPUs, and the observe-only way."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "--cap-add SYS_ADMIN" in text
    assert "--gpus all" in text
    assert "POLCA_AGENT__OBSERVE_ONLY=true" in text


@pytest.mark.parametrize(
    ("path", "ignored"),
    [
        (".venv/bin/python", True),
        (".git/HEAD", True),
        ("tests/agent/test_sdnotify.py", True),
        ("systemd/polca-agent.service", True),
        ("bench/nvml_latency.py", True),
        ("daemon/polca/__pycache__/cli.cpython-311.pyc", True),
        ("daemon/polca.egg-info/PKG-INFO", True),
        ("pyproject.toml", False),
        ("requirements/runtime.txt", False),
        ("requirements/test.txt", True),
        ("README.md", False),
        ("LICENSE", False),
        ("daemon/polca/cli.py", False),
        ("daemon/polca/sdnotify.py", False),
        ("daemon/polca/py.typed", False),
    ],
)
def test_dockerignore(path: str, ignored: bool) -> None:
    """The build context holds the package sources and nothing else."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert _ignored(path, patterns) is ignored
