"""The suite's tiers stay true: a test that starts processes is marked ``subprocess``, one that starts gloo ranks
``distributed`` (``./scripts/test --fast`` leaves out both and ``slow``).

Read from the source, not run: every function of the test tree (tests, fixtures, helpers, in any module under
tests/) is followed through the names it uses, across the modules it imports from tests/, to what starts a process.
A test reaches a process start through its own body, the functions and classes it uses and the fixtures it takes.
What the source does not show (nanhunt verifying a bundle's repro in a fresh interpreter) is caught when the test
runs: tests/conftest.py fails an unmarked test that starts a Python process.
"""

from __future__ import annotations

import ast
import multiprocessing
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Modules whose use starts a process; and the os / pty functions that do.
PROCESS_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing"}
PROCESS_FUNCTIONS = {("os", "fork"), ("os", "forkpty"), ("os", "posix_spawn"), ("os", "posix_spawnp"), ("pty", "spawn"),
                     *(("os", f"exec{v}") for v in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe")),
                     *(("os", f"spawn{v}") for v in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe"))}
# What starts ranks: the suite's launchers (tests/_support/dist.py: torchrun, run_ranks), mp.spawn, or processes
# whose code (reached from the test, as a process target is) joins a gloo group.
RANK_FUNCTIONS = {"torchrun", "run_ranks"}
GROUP_TEXT = {"init_process_group", "gloo"}


@dataclass
class Node:
    """One function or class: whether its own code starts a process or ranks, and the names it uses."""

    process: bool = False
    ranks: bool = False
    group: bool = False  # joins a process group
    uses: set[tuple[str, str]] = field(default_factory=set)  # (module file, name) pairs it refers to


def _module_name(path: Path, root: Path) -> str:
    """``tests.unit.test_x`` for root/unit/test_x.py (root: the tests folder)."""
    return ".".join(path.relative_to(root.parent).with_suffix("").parts)


def _resolve(importer: Path, root: Path, module: str | None, level: int) -> str:
    """The dotted name ``from <level dots><module> import`` refers to, seen from ``importer``."""
    if level:
        base = _module_name(importer, root).split(".")[:-level]
        return ".".join(base + ([module] if module else []))
    return module or ""


class _Module:
    """A module under tests/: its top-level functions and classes as :class:`Node`, and what its names mean."""

    def __init__(self, path: Path, root: Path, files: dict[str, Path]) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.aliases: dict[str, str] = {}  # local name -> module it stands for (``import subprocess as sp``)
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module file, name) in the test tree
        self.from_std: dict[str, tuple[str, str]] = {}  # local name -> (module, name) outside it
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(path, root, node.module, node.level)
                for a in node.names:
                    local = a.asname or a.name
                    target = files.get(mod) or files.get(f"tests.{mod}")
                    if target is not None:
                        self.imported[local] = (str(target), a.name)
                    elif f"{mod}.{a.name}" in PROCESS_MODULES or mod in PROCESS_MODULES:
                        self.aliases[local] = f"{mod}.{a.name}" if f"{mod}.{a.name}" in PROCESS_MODULES else mod
                    else:
                        self.from_std[local] = (mod, a.name)
        self.nodes: dict[str, Node] = {}
        self.defs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] = {}
        for top in self.tree.body:
            if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[top.name] = top
                self.nodes[top.name] = self._node(top)

    def _node(self, tree: ast.AST) -> Node:
        node = Node()
        for sub in ast.walk(tree):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                node.group |= sub.value in GROUP_TEXT
            node.group |= isinstance(sub, ast.Attribute) and sub.attr in GROUP_TEXT
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                module = self.aliases.get(sub.value.id)
                if module in PROCESS_MODULES:
                    node.process = True
                    node.ranks |= sub.attr == "spawn"
                elif module is not None and (module, sub.attr) in PROCESS_FUNCTIONS:
                    node.process = True
            if isinstance(sub, ast.Name):
                if self.aliases.get(sub.id) in PROCESS_MODULES or self.from_std.get(sub.id) in PROCESS_FUNCTIONS:
                    node.process = True
                if sub.id in self.imported:
                    node.uses.add(self.imported[sub.id])
                else:
                    node.uses.add((str(self.path), sub.id))
        if isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # the fixtures it takes, found by name in its module or a conftest.py above it (see _Tree.fixture)
            node.uses.update(("fixture", a.arg) for a in tree.args.args + tree.args.kwonlyargs)
        return node


class _Tree:
    """Every module under tests/, and which of their functions reach a process start."""

    def __init__(self, root: Path) -> None:
        self.root = root
        paths = sorted(root.rglob("*.py"))
        files = {_module_name(p, root).removesuffix(".__init__"): p for p in paths}
        self.modules = {str(p): _Module(p, root, files) for p in paths}

    def fixture(self, module: str, name: str) -> tuple[str, str] | None:
        """Where the fixture ``name`` a test of ``module`` takes is defined: its module, else a conftest.py above."""
        folder = Path(module).parent
        candidates = [module] + [str(d / "conftest.py") for d in (folder, *folder.parents) if d.is_relative_to(self.root)]
        for c in candidates:
            m = self.modules.get(c)
            if m is not None and name in m.defs and _is_fixture(m.defs[name]):
                return c, name
        return None

    def reaches(self, module: str, name: str) -> tuple[bool, bool]:
        """(starts a process, starts ranks) for ``name`` of ``module``, through everything it uses."""
        seen: set[tuple[str, str]] = set()
        todo = [(module, name)]
        process = ranks = group = False
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            m = self.modules.get(key[0])
            node = m.nodes.get(key[1]) if m is not None else None
            if node is None or m is None:
                continue
            process |= node.process
            ranks |= node.ranks or key[1] in RANK_FUNCTIONS
            group |= node.group
            for used in node.uses:
                if used[0] == "fixture":
                    found = self.fixture(key[0], used[1])
                    if found is not None:
                        todo.append(found)
                else:
                    todo.append(used)
        return process, ranks or (process and group)


def _is_fixture(node: ast.AST) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any("fixture" in ast.unparse(d) for d in decorators)


def _marks(decorators: list[ast.expr]) -> set[str]:
    out = set()
    for d in decorators:
        text = ast.unparse(d)
        for mark in ("subprocess", "distributed", "slow"):
            if text.startswith(f"pytest.mark.{mark}"):
                out.add(mark)
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    for top in tree.body:
        if isinstance(top, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in top.targets):
            value = top.value
            items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            return _marks(list(items))
    return set()


def unmarked(root: Path = TESTS) -> list[str]:
    """Each test under ``root`` that starts a process or ranks without the marker that says so:
    ``file::test: needs mark``."""
    tree = _Tree(root)
    out = []
    for key, module in tree.modules.items():
        if not Path(key).name.startswith("test_"):
            continue
        base = _module_marks(module.tree)
        for name, node in module.defs.items():
            tests: list[tuple[str, set[str], str]] = []
            if isinstance(node, ast.ClassDef) and name.startswith("Test"):
                tests = [(f"{name}::{f.name}", _marks(node.decorator_list) | _marks(f.decorator_list), f.name)
                         for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and f.name.startswith("test")]
            elif name.startswith("test") and not isinstance(node, ast.ClassDef):
                tests = [(name, _marks(node.decorator_list), name)]
            for label, marks, _ in tests:
                process, ranks = tree.reaches(key, name)
                where = f"{Path(key).relative_to(root.parent)}::{label}"
                if ranks and "distributed" not in marks | base:
                    out.append(f"{where}: starts ranks, needs @pytest.mark.distributed")
                elif process and not ({"subprocess", "distributed"} & (marks | base)):
                    out.append(f"{where}: starts a process, needs @pytest.mark.subprocess")
    return sorted(out)


def test_every_test_that_starts_processes_is_marked() -> None:
    # a test that starts processes or ranks and says so can be left out of ./scripts/test --fast
    missing = unmarked()
    assert not missing, "\n".join(missing)


def _tree_of(tmp: Path, files: dict[str, str]) -> list[str]:
    """:func:`unmarked` run on a test tree made of ``files`` (path under tests/ -> source)."""
    for rel, text in files.items():
        (tmp / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "tests" / rel).write_text(text)
    return unmarked(tmp / "tests")


def test_the_check_follows_helpers_fixtures_and_aliases(tmp_path: Path) -> None:
    # GIVEN helpers that start a process, ranks (mp.spawn) and torchrun, used in several ways by tests
    helpers = ("import subprocess as sp\nimport torch.multiprocessing as mp\n"
               "def cli():\n    return sp.run(['true'])\n"
               "def ranks():\n    mp.spawn(print, nprocs=2)\n"
               "def torchrun(args):\n    return sp.run(['python', '-m', 'torch.distributed.run', *args])\n")
    tests = ("import pytest\nfrom tests.helpers import cli, ranks, torchrun\n"
             "@pytest.fixture\ndef ran():\n    return cli()\n"
             "def _indirect():\n    return ranks()\n"
             "def test_direct():\n    cli()\n"
             "def test_fixture(ran):\n    pass\n"
             "def test_ranks():\n    _indirect()\n"
             "@pytest.mark.subprocess\ndef test_launcher():\n    torchrun(['w.py'])\n"
             "@pytest.mark.subprocess\ndef test_marked():\n    cli()\n"
             "@pytest.mark.subprocess\ndef test_ranks_marked_as_process():\n    ranks()\n"
             "def test_plain():\n    pass\n")
    # WHEN the check reads them
    found = _tree_of(tmp_path, {"helpers.py": helpers, "unit/test_x.py": tests})
    # THEN each unmarked test is named with the marker it lacks; the marked and the plain ones pass
    assert found == [
        "tests/unit/test_x.py::test_direct: starts a process, needs @pytest.mark.subprocess",
        "tests/unit/test_x.py::test_fixture: starts a process, needs @pytest.mark.subprocess",
        "tests/unit/test_x.py::test_launcher: starts ranks, needs @pytest.mark.distributed",
        "tests/unit/test_x.py::test_ranks: starts ranks, needs @pytest.mark.distributed",
        "tests/unit/test_x.py::test_ranks_marked_as_process: starts ranks, needs @pytest.mark.distributed",
    ]


def test_a_module_mark_covers_its_tests(tmp_path: Path) -> None:
    # GIVEN a module marked as a whole whose test starts torchrun through subprocess
    text = ("import pytest, subprocess, sys\npytestmark = [pytest.mark.distributed, pytest.mark.slow]\n"
            "def test_launch():\n    subprocess.run([sys.executable, '-m', 'torch.distributed.run'])\n")
    # WHEN / THEN nothing is missing
    assert _tree_of(tmp_path, {"integration/test_y.py": text}) == []


@pytest.mark.subprocess
def test_the_run_time_watch_counts_python_processes_only() -> None:
    # GIVEN conftest's watch, on
    from tests.conftest import ProcessWatch

    watch = ProcessWatch(pytest.MonkeyPatch())
    watch.on()
    try:
        # WHEN a Python interpreter, another program and a multiprocessing process are started
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        subprocess.run(["true"], check=True)
        proc = multiprocessing.get_context("spawn").Process(target=int)
        proc.start()
        proc.join(60)
    finally:
        started = watch.off()
    # THEN the interpreter and the process are counted, the other program is not; and the watch is off again
    assert started == [f"{sys.executable} -c pass", "a multiprocessing process of <class 'int'>"]
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert len(watch.started) == 2
