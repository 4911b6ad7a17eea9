"""Imports point one way: data at the bottom, renderers torch-free, the CLI on top.

nanhunt's sub-packages, from the bottom up (:data:`ORDER`): a module imports from its own package or from one
below it, never from one above. The package root (``nanhunt/__init__.py``, ``__main__.py``) is the top: no module
imports it. Every import counts, one inside a function or under ``TYPE_CHECKING`` too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "nanhunt"

# The packages from the bottom up; "" is the package root (nanhunt/__init__.py, nanhunt/__main__.py).
ORDER = ["records", "_util", "distributed", "tracing", "step", "capture", "hunt", "guard", "comparison", "report",
         "integrations", "cli", ""]


def _imports(path: Path) -> set[str]:
    """Every name a module imports, with relative imports resolved to nanhunt.*: ``import a.b`` gives
    ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module: ``from torch import _C``)."""
    return _imports_of(path.read_text(), path.relative_to(PKG.parent).with_suffix("").parts[:-1])


def _imports_of(source: str, rel_base: tuple[str, ...]) -> set[str]:
    """:func:`_imports` of ``source``, a module of the package ``rel_base`` (its dotted parts)."""
    tree = ast.parse(source)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel_base[: len(rel_base) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module is not None:
                out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return out


def _modules() -> dict[str, Path]:
    """nanhunt's modules by dotted name (a package by its own name)."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _nanhunt(imports: set[str], modules: dict[str, Path] | None = None) -> set[str]:
    """The nanhunt modules among ``imports`` (``from .x import name``: the module x, not x.name)."""
    modules = _modules() if modules is None else modules
    out = set()
    for i in imports:
        if i != "nanhunt" and not i.startswith("nanhunt."):
            continue
        while i not in modules and "." in i:
            i = i.rsplit(".", 1)[0]
        out.add(i)
    return out


def _package(module: str) -> str:
    """The sub-package a module belongs to ("" for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] not in ("__main__",) else ""


def _torch(imports: set[str]) -> set[str]:
    return {i for i in imports if i == "torch" or i.startswith("torch.")}


def test_every_module_is_in_a_package_of_the_order() -> None:
    for name, f in _modules().items():
        assert _package(name) in ORDER, f"{f}: a package missing from ORDER"
        if _package(name) == "":
            assert f.name in ("__init__.py", "__main__.py"), f"{f}: a module at the root; put it in a package"


def test_packages_import_downward() -> None:
    # a lower package never imports a higher one; the root (the public API) is above all: none imports it
    modules = _modules()
    wrong = []
    for name, f in sorted(modules.items()):
        mine = ORDER.index(_package(name))
        for dep in sorted(_nanhunt(_imports(f), modules)):
            if dep != name and ORDER.index(_package(dep)) > mine:
                wrong.append(f"{name} imports {dep}")
    assert not wrong, wrong


def test_records_imports_nothing_from_nanhunt_nor_torch() -> None:
    # but its own private JSON serializer, which imports nothing from nanhunt nor torch either
    for f in (PKG / "records").glob("*.py"):
        imps = _imports(f)
        assert all(i == "nanhunt.records" or i.startswith("nanhunt.records.") for i in _nanhunt(imps)), f
        assert not _torch(imps), f
    assert not _nanhunt(_imports(PKG / "records" / "_serial.py"))


def test_skip_policy_is_plain_python() -> None:
    imps = _imports(PKG / "guard" / "_skip_policy.py")
    assert not _nanhunt(imps)
    assert not any(i.startswith(("torch", "numpy")) for i in imps)


def test_renderers_import_only_records_and_no_torch() -> None:
    allowed = {"nanhunt.records", "nanhunt._util._errors", "nanhunt._util._files", "nanhunt._util._bundle",
               "nanhunt._util._text", "nanhunt._util._limits", "nanhunt.report"}
    for f in (PKG / "report").glob("*.py"):
        imps = _imports(f)
        assert not _torch(imps), f
        assert {i for i in _nanhunt(imps) if not i.startswith("nanhunt.report.")} <= allowed, f


def test_graph_and_locate_are_pure() -> None:
    for name in ("graph.py", "locate.py"):
        imps = _imports(PKG / "tracing" / name)
        assert not _torch(imps), name
        assert _nanhunt(imps) <= {"nanhunt.records", "nanhunt.tracing.graph"}, name


def test_the_modules_that_run_the_users_step_exist() -> None:
    # the CLI blames an error whose last frame is in one of them on the user's step: a module moved or renamed
    # away from the list would make every such error "a nanhunt bug"
    from nanhunt.cli._common import CALL_THROUGH

    assert CALL_THROUGH <= set(_modules())


def test_nothing_imports_the_cli() -> None:
    for f in PKG.rglob("*.py"):
        if f.parent.name == "cli" or f.name == "__main__.py":
            continue
        assert not any(i == "nanhunt.cli" or i.startswith("nanhunt.cli.") for i in _imports(f)), f


# the modules allowed torch's internals: the dispatch machinery, and torch.compile's (dynamo, inductor)
_PRIVATE_TORCH = ("_util/_dispatch.py", "_util/_compiled.py")


def test_private_torch_imports_live_in_dispatch() -> None:
    # ``import torch._C``, ``from torch.utils import _pytree`` and ``from torch import _C`` alike
    private = re.compile(r"^torch(\.[A-Za-z]\w*)*\._")
    for f in PKG.rglob("*.py"):
        if f.relative_to(PKG).as_posix() in _PRIVATE_TORCH:
            continue
        for i in _torch(_imports(f)):
            assert not private.match(i), (f, i)


def test_the_private_import_check_sees_every_form() -> None:
    # the check above, on the forms it must catch
    private = re.compile(r"^torch(\.[A-Za-z]\w*)*\._")
    for src in ("import torch._C", "from torch._C import _get", "from torch import _C", "from torch.utils import _pytree",
                "from torch.utils._pytree import tree_map"):
        assert any(private.match(i) for i in _torch(_imports_of(src, ()))), src


def test_no_import_cycles() -> None:
    # every import counts, also one inside a function: a cycle there is a cycle of meaning
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        graph[name] = {d for d in _nanhunt(_imports(f), modules) if d != name and d != "nanhunt"}
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
    private = re.compile(r"\btorch\.(?:[a-z_]+\.)*_[a-zA-Z]\w*")
    for f in PKG.rglob("*.py"):
        if f.relative_to(PKG).as_posix() in _PRIVATE_TORCH:
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not private.search(code), f"{f.name}:{n}: {line.strip()}"


def test_dir_shows_the_public_api_only() -> None:
    import nanhunt

    assert dir(nanhunt) == sorted({*nanhunt.__all__, "last"})
    for name in ("Any", "sys", "importlib", "types", "annotations", "TYPE_CHECKING", "os"):
        assert not hasattr(nanhunt, name) or name in nanhunt.__all__, name


# A reader takes in a module, a function or a command's module whole: past these sizes it is time to cut one.
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_CLI_LINES = 700, 80, 150


def test_modules_and_functions_stay_readable() -> None:
    too_long = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(PKG).as_posix()
        limit = MAX_CLI_LINES if rel.startswith("cli/") else MAX_MODULE_LINES
        if text.count("\n") > limit:
            too_long.append(f"{rel}: {text.count(chr(10))} lines (at most {limit})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION_LINES})")
    assert too_long == []
