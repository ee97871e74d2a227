"""What the import contracts of pyproject.toml (``lint-imports``, run by ``nox -s lint``) cannot
say: import-linter sees modules, not names, so this test reads every module's imports with ast
and fails where one takes a private name (``_name``) of another room. A room is a directory or a
top-level module of the package (docs/architecture.md, "The rooms"): kernels, runtime, ops,
buffer, moe, megatron, deep_ep, tools, reference. Inside a room, modules may share private
helpers; between rooms, and so between the adapters, only public names pass."""

from __future__ import annotations

import ast
from pathlib import Path

import hybrid_ep_triton

PACKAGE = Path(hybrid_ep_triton.__path__[0])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _room(module: str) -> str:
    """The room of a dotted module name: its first component below the root package ("" for
    the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def crossings(package: Path) -> list[str]:
    """``file:line takes module.name`` for each private name (or private module) that a module
    of ``package`` imports from another room, at any depth (also inside functions)."""
    root = package.name
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        importer = ".".join(parts)
        base = parts[:-1]  # the package a relative import starts from, also for __init__
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                start = base[: len(base) - node.level + 1] if node.level else []
                module = ".".join(start + ([node.module] if node.module else []))
                targets = [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if not target.startswith(root + ".") or _room(target) == _room(importer):
                    continue
                if any(_private(part) for part in target.split(".")):
                    found.append(f"{path.relative_to(package)}:{node.lineno} takes {target}")
    return found


def test_no_private_name_crosses_a_room():
    assert len(list(PACKAGE.rglob("*.py"))) > 40, f"too few modules found under {PACKAGE}"
    found = crossings(PACKAGE)
    assert not found, "private names taken from another room:\n" + "\n".join(found)


def test_a_crossing_is_found(tmp_path):
    """A private name of another room fails, also imported inside a function or as a module;
    one of the same room passes."""
    package = tmp_path / "hybrid_ep_triton"
    (package / "deep_ep").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "deep_ep" / "a.py").write_text(
        "from .b import _inside\n"
        "from .. import Buffer as _Buffer\n"
        "def f():\n"
        "    from ..moe import Public, _helper\n"
        "    import hybrid_ep_triton.ops._private\n"
    )
    assert crossings(package) == [
        "deep_ep/a.py:4 takes hybrid_ep_triton.moe._helper",
        "deep_ep/a.py:5 takes hybrid_ep_triton.ops._private",
    ]
