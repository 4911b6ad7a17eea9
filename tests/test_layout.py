"""Imports point one way (STYLE.md): data at the bottom, renderers torch-free, the CLI on top."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nanhunt"


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
    imps = _imports(PKG / "records.py")
    assert not _nanhunt(imps)
    assert not any(i.startswith("torch") for i in imps)


def test_renderers_import_only_records_and_no_torch() -> None:
    for f in (PKG / "report").glob("*.py"):
        imps = _imports(f)
        assert not any(i == "torch" or i.startswith("torch.") for i in imps), f
        allowed = {"nanhunt.records", "nanhunt._errors", "nanhunt._files", "nanhunt.report"}
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
