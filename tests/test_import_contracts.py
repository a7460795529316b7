"""The import-linter contracts in pyproject.toml mean what they say: the whole package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import grimp

import polca

ROOT = Path(__file__).resolve().parents[1]


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def _top_level_modules() -> set[str]:
    package = Path(polca.__file__).parent
    names = {path.stem for path in package.glob("*.py") if path.stem != "__init__"}
    names |= {path.parent.name for path in package.glob("*/__init__.py")}
    return {f"polca.{name}" for name in names}


def test_every_top_level_module_sits_in_exactly_one_layer() -> None:
    """A module missing from the layers escapes them; a new one must say where it sits."""
    (layers,) = (c for c in _contracts() if c["type"] == "layers")
    listed = [name.strip() for layer in layers["layers"] for name in layer.split("|")]
    assert len(listed) == len(set(listed)), "a module is in two layers"
    assert set(listed) == _top_level_modules()


def test_each_vendor_library_contract_covers_the_whole_package() -> None:
    """'X only in Y' contracts check every module, with only Y's own imports of X ignored."""
    vendor = [c for c in _contracts() if " only in " in c["name"]]
    assert len(vendor) >= 4
    for contract in vendor:
        assert contract["source_modules"] == ["polca"], contract["name"]
        for ignored in contract["ignore_imports"]:
            importer, _, imported = (part.strip() for part in ignored.partition("->"))
            assert importer.startswith("polca."), ignored
            assert "*" not in importer, ignored  # one named module, not a pattern
            assert imported in contract["forbidden_modules"], ignored


def _documented_layers() -> list[set[str]]:
    """The layer table of docs/architecture.md, top to bottom: one set of modules per row."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return [
        {f"polca.{name}" for name in re.findall(r"`([\w.]+)`", row.split("|")[2])} for row in rows
    ]


def test_the_documented_layers_are_the_contract() -> None:
    """docs/architecture.md lists the same layers, in the same order, as import-linter."""
    (layers,) = (c for c in _contracts() if c["type"] == "layers")
    declared = [{name.strip() for name in layer.split("|")} for layer in layers["layers"]]
    assert _documented_layers() == declared


def test_the_package_has_no_import_cycle() -> None:
    """No module imports, directly or through others, a module that imports it.

    The ``acyclic_siblings`` contract checks siblings with packages taken whole; this
    checks every pair of modules.
    """
    graph = grimp.build_graph("polca")
    cycles = sorted(
        {
            tuple(sorted((module, imported)))
            for module in graph.modules
            if module.startswith("polca")
            for imported in graph.find_modules_directly_imported_by(module)
            if imported.startswith("polca")
            and graph.chain_exists(importer=imported, imported=module)
        }
    )
    assert cycles == []
