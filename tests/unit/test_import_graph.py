"""The house in planes, checked on the import graph drawn from the code (docs/architecture.md,
"The house in planes"): every import of a hvdlite module, TYPE_CHECKING and function-level
imports included, goes to the module's own floor or a lower one; no imports form a circle,
neither between modules nor between the parts directly under hvdlite/ (a package and a module
beside it on one floor may not import each other); and every module is under 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "hvdlite"

# Floors, bottom up. A module's floor is its longest matching prefix; sub-floors of the runtime
# are ordered too (observability below the device runtime, below the data planes, below the
# control plane, below the engine).
FLOORS: list[tuple[float, tuple[str, ...]]] = [
    (0.0, ("hvdlite.errors", "hvdlite.config", "hvdlite._ops", "hvdlite._lru", "hvdlite._threads",
           "hvdlite._handles", "hvdlite._adasum", "hvdlite._tensorref")),
    (1.0, ("hvdlite._vocab",)),
    (2.0, ("hvdlite._observe",)),
    (2.1, ("hvdlite._rankside",)),  # the launcher plane's in-rank half
    (2.15, ("hvdlite._exit",)),  # ending a job: MPI's abort, the exit guard
    (2.2, ("hvdlite._gpu",)),
    (2.3, ("hvdlite._backends",)),
    (2.4, ("hvdlite._control",)),
    (2.5, ("hvdlite._engine",)),
    (3.0, ("hvdlite", "hvdlite._api", "hvdlite._collectives", "hvdlite._submit",
           "hvdlite._sets", "hvdlite._tensors", "hvdlite._torchref", "hvdlite.torch",
           "hvdlite.elastic")),
    (4.0, ("hvdlite.run", "hvdlite.doctor", "hvdlite.launcher")),  # the launcher plane
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                found = known(t)
                if found is not None and found != mod:
                    edges[mod].add(found)
    return edges


def _floor(mod: str) -> float:
    best, level = -1, -1.0
    for floor, prefixes in FLOORS:
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, level = len(p), floor
    assert best >= 0, f"{mod} is on no floor: add it to FLOORS and to docs/architecture.md"
    return level


def test_every_import_goes_to_its_floor_or_below() -> None:
    mods = _modules()
    up = [f"{a} ({_floor(a)}) -> {b} ({_floor(b)})"
          for a, bs in _edges(mods).items() for b in sorted(bs) if _floor(b) > _floor(a)]
    assert up == [], "imports from a lower floor to a higher one:\n" + "\n".join(up)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for nxt in sorted(edges[mod]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[mod] = 2

    for mod in sorted(edges):
        if mod not in state:
            visit(mod, [mod])
    return circles


def test_no_import_circle() -> None:
    assert _circles(_edges(_modules())) == []


def _part(mod: str) -> str:
    """The package or module directly under hvdlite/ that ``mod`` belongs to."""
    return ".".join(mod.split(".")[:2])


def test_no_import_circle_between_parts() -> None:
    """A circle through two parts is one arrow back up, whatever the floors say: e.g.
    _rankside.watchdog -> _exit -> _rankside.protocol, both once on one floor."""
    parts: dict[str, set[str]] = {}
    for mod, targets in _edges(_modules()).items():
        parts.setdefault(_part(mod), set()).update(
            _part(t) for t in targets if _part(t) != _part(mod))
    assert _circles(parts) == []


def test_every_module_is_under_600_lines() -> None:
    long = {str(path.relative_to(PKG.parent)): n for path in PKG.rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) >= 600}
    assert long == {}, f"modules of 600 lines or more (split them): {long}"


def test_the_vocabulary_imports_nothing_above_it() -> None:
    edges = _edges(_modules())
    for mod, targets in edges.items():
        if mod.startswith("hvdlite._vocab"):
            assert all(_floor(t) <= 1.0 for t in targets), (mod, sorted(targets))


def test_frontends_ask_the_runtime_and_never_reach_into_it() -> None:
    """``hvdlite.torch`` reaches the runtime only through the frontend floor's API
    (``_runtime_api``, ``_api``, ``_submit``, ``_torchref``): it imports nothing from the
    engine, the control plane, the device runtime or the data planes."""
    mods = _modules()
    edges = _edges(mods)
    inner = ("hvdlite._engine", "hvdlite._gpu", "hvdlite._backends", "hvdlite._control")
    bad = sorted(f"{a} -> {b}" for a, targets in edges.items()
                 if a == "hvdlite.torch" or a.startswith("hvdlite.torch.")
                 for b in targets if any(b == p or b.startswith(p + ".") for p in inner))
    assert not bad, "hvdlite.torch reaches into the runtime: " + "; ".join(bad)
