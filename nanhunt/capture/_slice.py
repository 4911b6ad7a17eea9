"""The def-use slice of a user's script: the module-level statements its definitions use, and nothing else.

A replay that rebuilds a model or loss defined in a script runs, whatever the name, the script's imports and its
*inert* statements: the function and class definitions, assignments and ``if`` / ``try`` blocks whose running
calls nothing of the script's (:func:`_inert` says exactly what they may hold) and that read only names such
statements, imports or builtins bind (:func:`_definitions`). Any other statement of the forms it knows (an
assignment, a method called as a statement, a definition, an ``if`` / ``try`` block) runs only when the name, or a
statement that runs, reads what it assigns or changes (``parser = ...``, ``parser.add_argument(...)``,
``args = parser.parse_args()``), whatever it calls; found from the syntax tree. Never loops, ``with``, ``match``,
``del``, ``assert``, plain calls or the main block. The Guard also reads the slice, without running anything, to
say when it is made what a replay would lack.
"""

from __future__ import annotations

import ast
import builtins
import symtable
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["def_use_slice", "where_set", "Slice", "ELSEWHERE", "MODULE_NAMES", "RUNS_ONLY"]


def _is_main_block(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``"""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    t = node.test
    sides = [t.left, *t.comparators]
    return (len(sides) == 2 and any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


_DEFINES = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_ALIAS: Any = getattr(ast, "TypeAlias", ())  # ``type X = ...`` (Python 3.12); () matches nothing before
# what a module holds before its first statement runs (and its annotations once one is annotated)
MODULE_NAMES = frozenset(vars(types.ModuleType("m"))) | {"__file__", "__builtins__", "__annotations__"}
_CODE = (ast.Call, ast.Await, ast.Yield, ast.YieldFrom)
# a class's methods Python calls when the class is subclassed or subscripted; a module's on a lookup of it
_CLASS_HOOKS = frozenset({"__init_subclass__", "__class_getitem__"})
_MODULE_HOOKS = frozenset({"__getattr__", "__dir__"})
_BUILTIN_DECORATORS = frozenset({"staticmethod", "classmethod", "property"})
_ACCESSORS = frozenset({"setter", "getter", "deleter"})


def _evaluated(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and every node evaluated with it: all below it but a lambda's body, which runs when called."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        todo.extend([n.args] if isinstance(n, ast.Lambda) else ast.iter_child_nodes(n))


def _calls(node: ast.AST) -> bool:
    """Evaluating ``node`` calls something: a call, an ``await`` or a ``yield`` anywhere in it."""
    return any(isinstance(n, _CODE) for n in _evaluated(node))


def _annotation_calls(node: ast.AST) -> bool:
    """An annotation (or a type alias's value, a type parameter's bound) calls something when evaluated, it or a
    string in it: every annotation counts as evaluated, under ``from __future__ import annotations`` and for a
    PEP 695 alias too, since libraries evaluate them when the class is made (dataclasses, pydantic) or later
    (``typing.get_type_hints``)."""
    if _calls(node):
        return True
    for n in _evaluated(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                inner = ast.parse(n.value.strip(), mode="eval")
            except (SyntaxError, ValueError):
                continue  # not an expression: evaluating it raises before it calls anything
            except (RecursionError, MemoryError):
                return True  # too deep to read: counted as calling
            if _annotation_calls(inner.body):
                return True
    return False


@dataclass(frozen=True)
class _Scope:
    """Where a statement runs: ``library`` holds the names a decorator or metaclass of an inert definition may
    start from (bound only by an import, or a builtin decorator the script does not rebind); in a class body,
    ``methods`` holds the names its functions bind (``@x.setter``)."""

    library: frozenset[str]
    methods: frozenset[str] = frozenset()
    in_class: bool = False


def _inert(node: ast.stmt, scope: _Scope) -> bool:
    """Running ``node`` (at the module level, or in a class body) calls no function, but the decorators and
    metaclasses of definitions that :func:`_library_callee` allows: nothing evaluated in it (targets, subscripts,
    slices, values, ``except`` types, tests, defaults, annotations, bases, keywords, class bodies,
    comprehensions, f-strings, walrus) holds a call. An import, ``pass``, ``global``, a docstring, an assignment,
    a definition, an ``if`` (not the main block) or ``try`` block of these, or a type alias."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass, ast.Global)):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _inert_function(node, scope)
    if isinstance(node, ast.ClassDef):
        return _inert_class(node, scope)
    if isinstance(node, ast.Assign):
        return not any(map(_calls, [*node.targets, node.value]))
    if isinstance(node, ast.AugAssign):
        return not _calls(node.target) and not _calls(node.value)
    if isinstance(node, ast.AnnAssign):
        return not (_calls(node.target) or node.value is not None and _calls(node.value)
                    or _annotation_calls(node.annotation))
    if isinstance(node, ast.If):
        return (not _is_main_block(node) and not _calls(node.test)
                and all(_inert(s, scope) for s in node.body + node.orelse))
    if isinstance(node, ast.Try):
        return (not any(h.type is not None and _calls(h.type) for h in node.handlers)
                and all(_inert(s, scope) for s in _blocks(node)))
    if isinstance(node, _ALIAS):
        return not any(map(_annotation_calls, [node.value, *node.type_params]))
    return False


def _inert_function(node: ast.FunctionDef | ast.AsyncFunctionDef, scope: _Scope) -> bool:
    """A ``def`` runs its decorators, default values and annotations; its body runs when called. A module's own
    ``__getattr__`` or ``__dir__`` is called by a lookup of the module, so it is not inert."""
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p is not None)]
    annotations = [p.annotation for p in params if p.annotation is not None]
    return not ((not scope.in_class and node.name in _MODULE_HOOKS)
                or not all(_library_callee(d, scope) for d in node.decorator_list)
                or any(map(_calls, [*a.defaults, *(d for d in a.kw_defaults if d is not None)]))
                or any(map(_annotation_calls, [*annotations, *([node.returns] if node.returns else []),
                                               *getattr(node, "type_params", [])])))


def _inert_class(node: ast.ClassDef, scope: _Scope) -> bool:
    """A ``class`` runs its decorators, bases, keywords (a metaclass is called) and body; a class that defines
    ``__init_subclass__`` or ``__class_getitem__`` has the script's code run by a subclass or a subscript of it,
    so it is not inert (and neither is what reads it)."""
    local = _class_locals(node.body)
    methods = frozenset(s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)))
    inner = _Scope(scope.library - local, methods, in_class=True)
    return not (local & _CLASS_HOOKS
                or not all(_library_callee(d, scope) for d in node.decorator_list)
                or any(map(_calls, node.bases))
                or not all(_library_callee(k.value, scope) if k.arg == "metaclass" else not _calls(k.value)
                           for k in node.keywords)
                or any(map(_annotation_calls, getattr(node, "type_params", [])))
                or not all(_inert(s, inner) for s in node.body))


def _library_callee(node: ast.expr, scope: _Scope) -> bool:
    """A decorator or metaclass an inert definition may have: a library name or an attribute of one
    (``dataclass``, ``torch.no_grad``, ``abc.ABCMeta``, ``staticmethod``), called at most once with arguments that
    call nothing (``dataclasses.dataclass(frozen=True)``); in a class body, also a method's ``.setter``,
    ``.getter`` or ``.deleter``. Imports run the library's code anyway: its decorator runs more of it, never the
    script's."""
    args: list[ast.expr] = []
    if isinstance(node, ast.Call):
        args, node = [*node.args, *(k.value for k in node.keywords)], node.func
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or any(map(_calls, args)):
        return False
    return node.id in scope.library or (node.id in scope.methods and len(chain) == 1 and chain[0] in _ACCESSORS)


def _class_locals(body: list[ast.stmt]) -> frozenset[str]:
    """The names a class body binds (over-counted: any name stored anywhere in it but in its functions and
    classes), which its decorators look up before the module's."""
    out: set[str] = set()
    todo: list[ast.AST] = list(body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            todo.extend([*n.decorator_list, *getattr(n, "bases", []), *getattr(n, "keywords", [])])
            continue
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).partition(".")[0] for a in n.names)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        todo.extend(ast.iter_child_nodes(n))
    return frozenset(out)


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
    """A statement the replay may run when the name or a statement that runs needs it: an assignment (any value),
    a definition, an import, a type alias, a docstring, a method called as a statement, ``pass``, or an ``if`` /
    ``try`` block (not the main block) made of these. Never a loop, a ``with`` or ``match`` block, a plain call
    (``train(model)``), ``del``, ``raise`` or ``assert``."""
    if isinstance(node, (*_DEFINES, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass, _ALIAS)):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant) or bool(_mutated(node))
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
    runnable: bool  # runs when something that runs needs what it assigns or changes (:func:`_runnable`)
    binds: frozenset[str]  # the module-level names it assigns, imports or defines
    assigns: frozenset[str]  # those it binds otherwise than by an import
    mutates: frozenset[str]  # the names whose object it changes
    now: frozenset[str]  # the module-level names it reads as it runs (decorators, defaults, class bodies)
    reads: frozenset[str]  # the same, annotations counted as read under ``from __future__ import annotations``
    later: frozenset[str]  # the module-level names its functions and lambdas read when called
    set_later: frozenset[str]  # module-level names its functions assign (``global _cache``)


_NOTHING: frozenset[str] = frozenset()


def _statement(node: ast.stmt, future: str) -> _Statement:
    if not _runnable(node):
        return _Statement(node, False, *[_NOTHING] * 7)
    binds, assigns, now, later, set_later = _scopes(node, future)
    reads = _scopes(node, "")[2] if future else now
    return _Statement(node, True, binds, assigns, frozenset(_mutated(node)), now, reads, later, set_later)


def _scopes(node: ast.stmt, future: str) -> tuple[frozenset[str], ...]:
    """What a statement binds, assigns, reads now, reads later and assigns later at the module level, from its
    scopes as the compiler sees them (a function's locals and parameters are not module-level names; a class
    body's ``global`` and a comprehension's walrus are); under ``from __future__ import annotations`` (in
    ``future``) an annotation reads nothing."""
    table = symtable.symtable(future + ast.unparse(node), "<script statement>", "exec")
    top = [s for s in table.get_symbols() if s.get_name() != "annotations" or not future]
    now = {s.get_name() for s in top if s.is_referenced()}
    assigns = {s.get_name() for s in top if s.is_assigned()}
    imports = {s.get_name() for s in top if s.is_imported()}
    later: set[str] = set()
    set_later: set[str] = set()

    def scopes(t: symtable.SymbolTable, deferred: bool) -> None:
        for child in t.get_children():
            called = deferred or (child.get_type() == "function" and child.get_name() not in _COMPREHENSIONS)
            module = [s for s in child.get_symbols() if s.is_global()]
            (later if called else now).update(s.get_name() for s in module if s.is_referenced())
            (set_later if called else assigns).update(s.get_name() for s in module if s.is_assigned())
            scopes(child, called)

    scopes(table, False)
    assigns |= _walrus_targets(node)
    return (frozenset(assigns | imports), frozenset(assigns), frozenset(now), frozenset(later),
            frozenset(set_later))


def _walrus_targets(node: ast.stmt) -> set[str]:
    """The names a walrus in ``node`` binds at the module level as it runs, one in a comprehension included
    (symtable shows none of these from Python 3.12, which inlines comprehensions): any outside the bodies of its
    functions, lambdas and classes."""
    out: set[str] = set()
    todo: list[ast.AST] = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        if isinstance(n, ast.Lambda):
            todo.append(n.args)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = set(map(id, n.body))
            todo.extend(c for c in ast.iter_child_nodes(n) if id(c) not in body)
        else:
            todo.extend(ast.iter_child_nodes(n))
    return out


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


def _definitions(statements: list[_Statement], modules: set[str]) -> list[bool]:
    """Which statements run whatever the name: the inert ones (:func:`_inert`) whose every read name is a
    builtin, one a module holds, or one bound and changed only by such statements (a name a statement that
    calls assigns or changes is read only when needed: its value may be the script's own object, whose
    operators are the script's code)."""
    rebound = set().union(*(s.assigns | s.set_later for s in statements))
    library = _Scope(frozenset(modules - rebound) | (_BUILTIN_DECORATORS - rebound - modules))
    keep = [s.runnable and _inert(s.node, library) for s in statements]
    by: dict[str, list[int]] = {}
    for i, s in enumerate(statements):
        for n in s.binds | (s.mutates - modules):
            by.setdefault(n, []).append(i)

    def settled(n: str) -> bool:
        where = by.get(n)
        return n in MODULE_NAMES or hasattr(builtins, n) if where is None else all(keep[j] for j in where)

    changed = True
    while changed:
        changed = False
        for i, s in enumerate(statements):
            if keep[i] and not all(map(settled, s.reads)):
                keep[i] = False
                changed = True
    return keep


@dataclass(frozen=True)
class Slice:
    """What the replay runs of a script for one name, and the module-level names that name needs."""

    body: list[ast.stmt]
    needed: frozenset[str]
    set_later: frozenset[str]
    bound: frozenset[str]  # the module-level names its statements assign, import or define


def def_use_slice(tree: ast.Module, name: str | None) -> Slice:
    """Every definition (:func:`_definitions`), and the runnable statements (:func:`_runnable`) that assign or
    change a name that ``name`` or a statement that runs needs (read when it runs, or when something ``name``
    needs is called), transitively; in the script's order."""
    future = "from __future__ import annotations\n" if any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body) else ""
    statements = [_statement(node, future) for node in tree.body]
    modules = _imported(tree.body)
    kept = _definitions(statements, modules)
    needed: set[str] = {name} if name else set()
    for s, definition in zip(statements, kept):
        if definition:
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
        [node.name] if isinstance(node, _ALIAS) else
        [i.optional_vars for i in node.items if i.optional_vars is not None]
        if isinstance(node, (ast.With, ast.AsyncWith)) else [])
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


RUNS_ONLY = ("a replay runs only a script's definitions and the module-level statements they use (never its main "
              "block, loops, with blocks or plain calls)")
ELSEWHERE = "put what the replay needs in a module and pass it as package.module:name"
