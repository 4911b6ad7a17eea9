"""Imports point one way (STYLE.md): data at the bottom, renderers torch-free, the CLI on top."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "nanhunt"


def _imports(path: Path) -> set[str]:
    """Top-level names imported by a module, with relative imports resolved to nanhunt.*."""
    tree = ast.parse(path.read_text())
    rel_base = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel_base[: len(rel_base) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    out.update(f"{mod}.{a.name}" for a in node.names)
                else:
                    out.add(mod)
            elif node.module:
                out.add(node.module)
    return out


def _nanhunt(imports: set[str]) -> set[str]:
    return {i for i in imports if i == "nanhunt" or i.startswith("nanhunt.")}


def test_records_imports_nothing_from_nanhunt_nor_torch() -> None:
    # but its private JSON serializer, which imports nothing from nanhunt nor torch either
    imps = _imports(PKG / "records.py")
    assert _nanhunt(imps) <= {"nanhunt._serial"}
    assert not any(i.startswith("torch") for i in imps)
    serial = _imports(PKG / "_serial.py")
    assert not _nanhunt(serial)
    assert not any(i.startswith("torch") for i in serial)


def test_skip_policy_is_plain_python() -> None:
    imps = _imports(PKG / "_skip_policy.py")
    assert not _nanhunt(imps)
    assert not any(i.startswith(("torch", "numpy")) for i in imps)


def test_renderers_import_only_records_and_no_torch() -> None:
    for f in (PKG / "report").glob("*.py"):
        imps = _imports(f)
        assert not any(i == "torch" or i.startswith("torch.") for i in imps), f
        # _files and _bundle write what the renderers made (plain Python, no torch)
        allowed = {"nanhunt.records", "nanhunt._errors", "nanhunt._files", "nanhunt._bundle", "nanhunt.report"}
        assert _nanhunt(imps) <= allowed | {i for i in _nanhunt(imps) if i.startswith("nanhunt.report.")}, f


def test_graph_and_locate_are_pure() -> None:
    for name in ("graph.py", "locate.py"):
        imps = _imports(PKG / name)
        assert not any(i == "torch" or i.startswith("torch.") for i in imps), name
        assert _nanhunt(imps) <= {"nanhunt.records", "nanhunt.graph"}, name


def test_nothing_imports_the_cli() -> None:
    for f in PKG.rglob("*.py"):
        if f.name in ("cli.py", "__main__.py"):
            continue
        assert "nanhunt.cli" not in _imports(f), f


def test_private_torch_imports_live_in_dispatch() -> None:
    for f in PKG.rglob("*.py"):
        if f.name == "_dispatch.py":
            continue
        for i in _imports(f):
            assert not i.startswith("torch.utils._") and not i.startswith("torch._"), (f, i)


def _module_name(f: Path) -> str:
    parts = f.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles() -> None:
    # every import counts, also one inside a function: a cycle there is a cycle of meaning
    modules = {_module_name(f): f for f in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        deps = set()
        for i in _nanhunt(_imports(f)):
            while i not in modules and "." in i:
                i = i.rsplit(".", 1)[0]  # `from . import _dispatch`: the module itself, or its package
            if i in modules and i != name and i != "nanhunt":
                deps.add(i)
        graph[name] = deps
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [n, d])
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


def test_private_torch_attributes_live_in_dispatch() -> None:
    # torch._C, torch.utils._python_dispatch, ... are torch's internals: one module wraps them
    import re

    private = re.compile(r"\btorch\.(?:[a-z_]+\.)*_[a-zA-Z]\w*")
    for f in PKG.rglob("*.py"):
        if f.name == "_dispatch.py":
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not private.search(code), f"{f.name}:{n}: {line.strip()}"
