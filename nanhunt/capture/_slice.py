"""The def-use slice of a user's script: the module-level statements its definitions use, and nothing else.

A replay that rebuilds a model or loss defined in a script runs the script's ``def`` and ``class`` statements,
its imports, and only the module-level statements that bind a name they use (``parser = ...``, ``add_argument``,
``args = parser.parse_args()``, ``HIDDEN = args.hidden``), found from the script's syntax tree; never loops,
``with``, plain calls or the main block. The Guard also reads the slice, without running anything, to say when
it is made what a replay would lack.
"""

from __future__ import annotations

import ast
import symtable
from dataclasses import dataclass

__all__ = ["def_use_slice", "where_set", "Slice", "ELSEWHERE", "RUNS_ONLY"]


def _is_main_block(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``"""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    t = node.test
    sides = [t.left, *t.comparators]
    return (len(sides) == 2 and any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


_DEFINES = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _calls(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) for n in ast.walk(node))


def _defines(node: ast.stmt) -> bool:
    """A statement that only defines: an import, a function, a class, an assignment that calls nothing
    (``EPS = 1e-6``), a docstring, or an ``if`` / ``try`` block made of these (``try: import apex``)."""
    if isinstance(node, _DEFINES):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return node.value is not None and not _calls(node.value)
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)
    if isinstance(node, ast.If):
        return not _is_main_block(node) and not _calls(node.test) and all(map(_defines, node.body + node.orelse))
    if isinstance(node, ast.Try):
        return all(map(_defines, _blocks(node)))
    return False


def _blocks(node: ast.Try) -> list[ast.stmt]:
    return node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]


def _root(node: ast.expr) -> str | None:
    """The name an attribute or item chain starts from: ``parser`` of ``parser.add_argument``, ``cfg`` of
    ``cfg["lr"]``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _mutated(node: ast.stmt) -> set[str]:
    """The names whose object a statement changes without assigning them: a method called as a statement
    (``parser.add_argument(...)``), an attribute or item assigned (``args.hidden = 16``)."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        root = _root(node.value.func)
        return {root} if root else set()
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    out: set[str] = set()
    for t in targets:
        for part in t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]:
            root = _root(part) if isinstance(part, (ast.Attribute, ast.Subscript)) else None
            if root:
                out.add(root)
    if isinstance(node, ast.If):
        return set().union(*map(_mutated, node.body + node.orelse))
    if isinstance(node, ast.Try):
        return set().union(*map(_mutated, _blocks(node)))
    return out


def _runnable(node: ast.stmt) -> bool:
    """A statement the replay may run when a definition needs it: an assignment (any value), a method called
    as a statement, ``pass``, or an ``if`` / ``try`` block (not the main block) made of these and definitions.
    Never a loop, a ``with`` block, a plain call (``train(model)``), ``del``, ``raise`` or ``assert``."""
    if _defines(node) or isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass)):
        return True
    if isinstance(node, ast.Expr):
        return bool(_mutated(node))
    if isinstance(node, ast.If):
        return not _is_main_block(node) and all(map(_runnable, node.body + node.orelse))
    if isinstance(node, ast.Try):
        return all(map(_runnable, _blocks(node)))
    return False


_COMPREHENSIONS = ("listcomp", "setcomp", "dictcomp", "genexpr")


@dataclass(frozen=True)
class _Statement:
    """A top-level statement of a script, as the slice sees it."""

    node: ast.stmt
    definition: bool  # always runs (:func:`_defines`)
    runnable: bool  # runs when a definition needs what it assigns or changes (:func:`_runnable`)
    binds: frozenset[str]  # the module-level names it assigns
    mutates: frozenset[str]  # the names whose object it changes
    now: frozenset[str]  # the module-level names it reads as it runs (decorators, defaults, class bodies)
    later: frozenset[str]  # the module-level names its functions and lambdas read when called
    set_later: frozenset[str]  # module-level names its functions assign (``global _cache``)


def _statement(node: ast.stmt, future: str) -> _Statement:
    definition, runnable = _defines(node), _runnable(node)
    if not runnable:
        return _Statement(node, False, False, frozenset(), frozenset(), frozenset(), frozenset(), frozenset())
    # the scopes as the compiler sees them (a function's locals and parameters are not module-level names);
    # under ``from __future__ import annotations`` an annotation reads nothing
    table = symtable.symtable(future + ast.unparse(node), "<script statement>", "exec")
    top = [s for s in table.get_symbols() if s.get_name() != "annotations" or not future]
    now = {s.get_name() for s in top if s.is_referenced()}
    later: set[str] = set()
    set_later: set[str] = set()

    def scopes(t: symtable.SymbolTable, deferred: bool) -> None:
        for child in t.get_children():
            called = deferred or (child.get_type() == "function" and child.get_name() not in _COMPREHENSIONS)
            read = {s.get_name() for s in child.get_symbols() if s.is_global() and s.is_referenced()}
            (later if called else now).update(read)
            if called:
                set_later.update(s.get_name() for s in child.get_symbols() if s.is_global() and s.is_assigned())
            scopes(child, called)

    scopes(table, False)
    binds = frozenset(s.get_name() for s in top if s.is_assigned() or s.is_imported())
    return _Statement(node, definition, True, binds, frozenset(_mutated(node)), frozenset(now), frozenset(later),
                      frozenset(set_later))


def _imported(nodes: list[ast.stmt]) -> set[str]:
    """The module-level names an import binds (a module changed by a call is not a value a definition reads:
    ``torch.manual_seed(0)`` does not run for ``torch``)."""
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, ast.If):
            out |= _imported(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            out |= _imported(_blocks(node))
    return out


@dataclass(frozen=True)
class Slice:
    """What the replay runs of a script for one name, and the module-level names that name needs."""

    body: list[ast.stmt]
    needed: frozenset[str]
    set_later: frozenset[str]
    bound: frozenset[str]  # the module-level names its statements assign, import or define


def def_use_slice(tree: ast.Module, name: str | None) -> Slice:
    """Every definition (:func:`_defines`), and the runnable statements (:func:`_runnable`) that assign or change
    a name that ``name`` or a definition needs (read when a definition runs, or when something ``name`` needs is
    called), transitively; in the script's order."""
    future = "from __future__ import annotations\n" if any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body) else ""
    statements = [_statement(node, future) for node in tree.body]
    modules = _imported(tree.body)
    kept = [s.definition for s in statements]
    needed: set[str] = {name} if name else set()
    for s in statements:
        if s.definition:
            needed |= s.now
    grew = True
    while grew:
        grew = False
        for i, s in enumerate(statements):
            uses: frozenset[str] = s.later if s.binds & needed else frozenset()
            if not kept[i]:
                if not s.runnable or not (s.binds & needed or (s.mutates - modules) & needed):
                    continue
                kept[i], grew, uses = True, True, s.now | s.later
            if not uses <= needed:
                needed |= uses
                grew = True
    ran = [s for s, keep in zip(statements, kept) if keep]
    set_later: set[str] = set()
    bound: set[str] = set()
    for s in ran:
        set_later |= s.set_later
        bound |= s.binds
    return Slice([s.node for s in ran], frozenset(needed), frozenset(set_later), frozenset(bound))


def where_set(tree: ast.Module, name: str) -> str:
    """Where the script assigns ``name`` at the module level, in statements the replay does not run: "only in
    a loop (line 12)"."""
    found = _first_binding(tree.body, name, None)
    if found is None:
        return "nowhere at the module level"
    where, line = found
    return f"only in {where} (line {line})"


def _first_binding(nodes: list[ast.stmt], name: str, around: str | None) -> tuple[str, int] | None:
    """The first statement among ``nodes`` (and the blocks inside them, not functions' or classes' bodies) that
    binds ``name``, with what kept the replay from running it: ``around`` (what the enclosing statement is),
    else its own kind."""
    for node in nodes:
        kind = around or _kept_out(node)
        if name in _bound(node):
            return kind, node.lineno
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        inner = [s for field in ("body", "orelse", "finalbody") for s in getattr(node, field, [])]
        found = _first_binding(inner + [s for h in getattr(node, "handlers", []) for s in h.body], name, kind)
        if found is not None:
            return found
    return None


def _kept_out(node: ast.stmt) -> str:
    """Why a top-level statement that binds a name the replay needs did not bind it there."""
    if _is_main_block(node):
        return 'its `if __name__ == "__main__":` block'
    if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
        return "a loop"
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return "a `with` block"
    return "a branch that did not run" if _runnable(node) else "a statement the replay never runs"


def _bound(node: ast.stmt) -> set[str]:
    """The names a statement itself binds (its targets, its imports, the function or class it defines)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).partition(".")[0] for a in node.names}
    targets: list[ast.expr] = (
        list(node.targets) if isinstance(node, ast.Assign) else
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)) else
        [i.optional_vars for i in node.items if i.optional_vars is not None]
        if isinstance(node, (ast.With, ast.AsyncWith)) else [])
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


RUNS_ONLY = ("a replay runs only a script's definitions and the module-level statements they use (never its main "
              "block, loops, with blocks or plain calls)")
ELSEWHERE = "put what the replay needs in a module and pass it as package.module:name"
