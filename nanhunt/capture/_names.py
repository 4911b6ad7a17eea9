"""Names of the user's own code in a capture: what the file records, and what its replay needs confirmed.

A model class or loss function defined in the script that trains (``__main__``) has no importable name. The
capture records it by the script's absolute path (``/home/me/train.py:my_loss``); the replay imports it only
when you confirm that name (``--loss /home/me/train.py:my_loss``) and then runs only the script's imports
(the modules they import run), function and class definitions (their decorators, default values and class
bodies run) and the assignments and ``if`` / ``try`` blocks that call nothing (``EPS = 1e-6``), never its loops,
``with`` blocks, calls (``model = Net()``, ``fit(model)``) or ``if __name__ == "__main__":`` block, so
confirming the name does not train again (what runs may still register an ``atexit`` function). A name
defined in a notebook or an interactive session cannot be imported at all: it is recorded as ``__main__:name``
and the replay asks for your own module's.

:func:`torch_own` is the rule for a name read from a file, judged by the name before anything is imported:
torch.nn's own module classes (a model or a loss), torch.nn.functional's losses and torch.optim's optimizers
are used as the file says; any other name is a suggestion, used only when you confirm it (``--model`` /
``--loss`` / ``--optimizer``) or trust its package (:func:`trusted_prefixes`).

:func:`confirmations` tells, when the capture is written, which of its names a replay will refuse unconfirmed:
the Guard prints its replay command with those flags, so that the command works as printed.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import keyword
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._util._errors import CommandError

__all__ = ["NeedsConfirmation", "capture_name", "is_script", "is_session", "load_script", "confirmations", "recognised",
           "loaded_from", "torch_own", "is_main_module", "trusted_prefixes", "trusted_by", "FLAGS", "TRUST_ENV"]

FLAGS = {"model factory": "--model", "loss function": "--loss", "optimizer class": "--optimizer"}
TRUST_ENV = "NANHUNT_TRUST_NAMES"  # package prefixes a team trusts, comma-separated (--trust-names, for everyone)
# torch.nn.functional's losses: the only functions a file may name (the loss is called on the model's
# output and the file's targets; torch.save, torch.from_file and the like would act on them too)
_LOSS_NAMES = (
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "cosine_embedding_loss", "cross_entropy",
    "ctc_loss", "gaussian_nll_loss", "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss",
    "margin_ranking_loss", "mse_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "nll_loss", "poisson_nll_loss", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss", "triplet_margin_with_distance_loss",
)


class NeedsConfirmation(CommandError):
    """A name read from a file that nanhunt imports only when you pass it as ``flag`` (you trust it)."""

    def __init__(self, message: str, *, what: str, path: str) -> None:
        super().__init__(message)
        self.what, self.path = what, path
        self.flag = FLAGS.get(what, "--model")


def under(module: str, prefix: str) -> bool:
    """``module`` is the package or module ``prefix`` or inside it, by whole dotted components (``mypkg`` holds
    ``mypkg.models``, not ``mypkgevil``)."""
    return module == prefix or module.startswith(prefix + ".")


def torch_own(module: str, what: str) -> bool:
    """A name in ``module`` that a file may choose unconfirmed: torch.nn's module classes and losses (``torch.nn``,
    ``torch.nn.modules.*``, the losses of ``torch.nn.functional``) and torch.optim's optimizers. What the name
    resolves to is checked after (:func:`recognised`); any other module needs a confirmation before it is
    imported, since importing it and calling its classes runs its code with the file's arguments."""
    if what == "optimizer class":
        return under(module, "torch.optim")
    if what == "loss function" and module == "torch.nn.functional":
        return True
    return what in ("model factory", "loss function") and (module == "torch.nn" or under(module, "torch.nn.modules"))


def is_main_module(module: str) -> bool:
    """``pkg.__main__`` (or a module inside one): importing it runs that program (certifi's, tqdm's, f2py's)."""
    return "__main__" in module.split(".")


def trusted_prefixes(given: Iterable[str] = ()) -> tuple[str, ...]:
    """The package prefixes whose names a file may choose: ``given`` (``--trust-names``) and :data:`TRUST_ENV`'s,
    each a dotted package or module name outside the standard library and torch (a prefix of torch would trust
    torch.save and torch.load as losses)."""
    env = [v.strip() for v in os.environ.get(TRUST_ENV, "").split(",") if v.strip()]
    out: list[str] = []
    for source, values in (("--trust-names", list(given)), (f"{TRUST_ENV} entry", env)):
        for v in values:
            top = v.partition(".")[0]
            why = ("is not a package name (mypkg or mypkg.models)" if not _dotted(v) or is_main_module(v) else
                   "would trust Python's own modules, which hold no model, loss or optimizer"
                   if top in sys.stdlib_module_names or top in sys.builtin_module_names else
                   "would trust torch's functions too (torch.nn's classes and losses and torch.optim's optimizers "
                   "need no trust; confirm any other torch name with --model, --loss or --optimizer)"
                   if top == "torch" else None)
            if why:
                raise CommandError(f"{source} {v!r} {why}; name your own package's prefix")
            out.append(v)
    return tuple(out)


def trusted_by(module: str, prefixes: Iterable[str]) -> bool:
    """``module`` is inside one of the trusted package ``prefixes``."""
    return any(under(module, p) for p in prefixes)


def _dotted(name: str) -> bool:
    return bool(name) and all(p.isidentifier() and not keyword.iskeyword(p) for p in name.split("."))


def is_script(path: str) -> bool:
    """``/dir/train.py:name``: a name defined in a script, recorded by the script's path."""
    where, sep, _ = path.rpartition(":")
    return bool(sep) and where.endswith(".py")


def is_session(path: str) -> bool:
    """``__main__:name``: a name defined in a notebook or interactive session (no file to import)."""
    return path.partition(":")[0] == "__main__"


def capture_name(obj: Any) -> str | None:
    """How a capture names a class or function (or an instance's class): ``package.module:qualname``; for one
    defined in the running script, the script's absolute path; in a notebook, ``__main__:qualname``."""
    target = obj if (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)) else type(obj)
    mod = getattr(target, "__module__", None)
    qual = getattr(target, "__qualname__", None)
    if not mod or not qual or "<" in qual:
        return None
    if mod != "__main__":
        return f"{mod}:{qual}"
    file = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(file, str) and file.endswith(".py") and os.path.isfile(file):
        return f"{os.path.abspath(file)}:{qual}"
    return f"__main__:{qual}"


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
        blocks = node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        return all(map(_defines, blocks))
    return False


def _definitions(tree: ast.Module) -> ast.Module:
    """The statements of a script that only define things (:func:`_defines`); its loops, ``with`` blocks,
    calls (``train(model)``, ``model = Net()``, ``history = fit(...)``) and main block are left out."""
    return ast.Module(body=[node for node in tree.body if _defines(node)], type_ignores=[])


def load_script(file: str) -> types.ModuleType:
    """The definitions of the script ``file`` as a module (see the module docstring); loaded once per path.

    Only for a name you confirmed: its imports and definitions run."""
    path = os.path.abspath(file)
    name = "_nanhunt_script_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    if not os.path.isfile(path):
        raise CommandError(f"script {file!r} does not exist; run from where it was captured or pass the "
                           "name as package.module:name")
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
        raise CommandError(f"cannot read script {file!r} ({type(e).__name__}: {e})") from e
    spec = importlib.util.spec_from_loader(name, loader=None, origin=path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = path
    where = os.path.dirname(path)
    saved = list(sys.path)
    sys.path.insert(0, where)  # the script's own imports (a model.py beside it), as when it ran
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    try:
        exec(compile(_definitions(tree), path, "exec"), module.__dict__)
    except BaseException as e:  # a Ctrl-C too: a half-run module is never handed out later
        sys.modules.pop(name, None)
        if not isinstance(e, Exception):
            raise
        raise CommandError(f"running the definitions of script {file!r} raised {type(e).__name__}: {e}; put what "
                           "the replay needs in a module and pass it as package.module:name") from e
    finally:
        sys.path[:] = saved
    return module


def confirmations(named: list[tuple[str, str | None, Any]]) -> tuple[list[str], list[str]]:
    """For ``(what, name, obj)`` (the capture's names and the live objects they name): the ``--flag name``
    arguments a replay needs for the file's names to be used, and notes for names no flag can confirm (defined
    in a notebook). Every name but torch's own (:func:`torch_own`) is confirmed, installed or not: trusting a
    package prefix is the replaying user's choice, not the file's."""
    args: list[str] = []
    notes: list[str] = []
    cwd = os.path.realpath(os.getcwd())
    explicit = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)}
    for what, name, obj in named:
        if name is None:
            continue
        flag = FLAGS[what]
        mod, _, qual = name.partition(":")
        if is_session(name):
            notes.append(f"{qual} is defined in this session (a notebook?): put it in a module and pass {flag} "
                         f"module:{qual}")
            continue
        kind = obj if obj is None or inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
        if not is_script(name) and torch_own(mod, what) and recognised(kind, what):
            continue
        where = loaded_from(sys.modules.get(mod.partition(".")[0]))
        file = getattr(sys.modules.get(mod), "__file__", None)
        if (not is_script(name) and where is not None and where not in explicit and where == _script_dir() != cwd
                and "." not in mod and isinstance(file, str) and file.endswith(".py")):
            # beside the script, not here: only its file finds it from this directory
            args += [flag, f"{os.path.abspath(file)}:{qual}"]
            continue
        args += [flag, name]
    return args, notes


def recognised(obj: Any, what: str) -> bool:
    """What a name read from an untrusted file may resolve to: a model class, an optimizer
    class, or a loss (an ``nn.Module`` class or one of torch.nn.functional's loss functions)."""
    if what == "optimizer class":
        return inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
    if inspect.isclass(obj):
        return issubclass(obj, nn.Module)
    if what == "loss function":
        return any(obj is getattr(F, n, None) for n in _LOSS_NAMES)
    return False


def loaded_from(module: Any) -> str | None:
    """The sys.path entry a top-level module or package was imported from (real path)."""
    if module is None:
        return None
    file: str | None = getattr(module, "__file__", None)
    if file:
        where = os.path.dirname(os.path.realpath(file))
        return os.path.dirname(where) if os.path.basename(file).startswith("__init__.") else where
    paths = list(getattr(module, "__path__", []) or [])  # a namespace package
    return os.path.dirname(os.path.realpath(paths[0])) if paths else None


# ------------------------------------------------------------------- saving


def _script_dir() -> str | None:
    file = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.dirname(os.path.realpath(file)) if isinstance(file, str) else None
