"""toymlx's layers (docs/DESIGN.md, "The layers"): every import of every module, at module level
or inside a function, read with `ast`; no module imports one that imports it back, however
far round, and each folder imports only itself and the folders of the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "toymlx"

LAYERS: list[tuple[str, ...]] = [  # bottom first: docs/DESIGN.md's drawing
    ("backend",),
    ("models",),
    ("gguf",),
    ("data",),
    ("bundle",),
    ("training",),
    ("recipes",),
    ("runner",),
    ("generation", "interop"),  # side by side: neither imports the other
    ("sweeps",),
]
ROOT = ""
"""The package's own modules (`toymlx/__init__.py`, `_moved.py`): above every layer."""
VERSION = ("toymlx", "__version__")
"""`from toymlx import __version__` reads the constant the package sets before any import."""


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported dotted name lives in (`toymlx.gguf.reader.GGUFFile` ->
    `toymlx.gguf.reader`)."""
    while name not in known:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the toymlx modules it imports, module-level and function-level alike."""
    graph: dict[str, set[str]] = {}
    for mod, path in known.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names
                         if (node.module, a.name) != VERSION]
            else:
                continue
            out.update(o for n in names if n.split(".")[0] == "toymlx"
                       and (o := _owner(n, known)) is not None and o != mod)
        graph[mod] = out
    return graph


def folder(mod: str) -> str:
    """The folder a module lies in (`ROOT` for the package's own modules)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) \
        else ROOT


def allowed() -> dict[str, set[str]]:
    """Folder -> the folders its modules may import: itself and every layer below."""
    may: dict[str, set[str]] = {}
    below: set[str] = set()
    for layer in LAYERS:
        for name in layer:
            may[name] = below | {name}
        below = below | set(layer)
    may[ROOT] = below | {ROOT}
    return may


def test_every_folder_is_in_a_layer():
    folders = {p.name for p in PACKAGE.iterdir()
               if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == {name for layer in LAYERS for name in layer}


def test_no_import_circle():
    graph = imports(modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                circle = path[path.index(dep):] + [dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def test_each_folder_imports_only_its_layer_and_below():
    may = allowed()
    wrong = sorted(f"{mod} ({folder(mod) or 'the package'}) imports {dep}"
                   for mod, deps in imports(modules()).items()
                   for dep in deps if folder(dep) not in may[folder(mod)])
    assert wrong == []


def test_the_checker_sees_function_level_imports(tmp_path):
    src = "def f():\n    from toymlx.gguf.reader import GGUFFile\n"
    known = {"toymlx.gguf.reader": tmp_path / "r.py", "toymlx.models.x": tmp_path / "x.py"}
    known["toymlx.gguf.reader"].write_text("")
    known["toymlx.models.x"].write_text(src)
    assert imports(known)["toymlx.models.x"] == {"toymlx.gguf.reader"}


def test_old_module_paths_import_with_a_warning():
    """toymlx 0.2's flat paths (the README's among them) still import, for one release."""
    import importlib
    import sys

    import pytest

    from toymlx._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to"):
            module = importlib.import_module(old)
        if len(new) == 1:
            assert module is importlib.import_module(new[0])
    used = {"toymlx.generate": ("generate", "load_for_generation"),  # the README's
            "toymlx.lora": ("apply_lora", "load_adapter", "write_merged"),
            "toymlx.runs": ("Bundle", "RunOptions", "fingerprint"),
            "toymlx.tokenizer": ("Tokenizer", "byte_metadata"), "toymlx.sweep": ("grid", "run_sweep")}
    for old, names in used.items():
        assert [n for n in names if not hasattr(sys.modules[old], n)] == []
