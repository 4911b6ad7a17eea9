"""Callable paths: the name of a model factory, a loss or an optimizer, and resolving one, judged by what it resolves to (a script's definitions by its path, a module only where it is found and allowed)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import keyword
import os
import sys
import types
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from typing import Any

import torch
from torch import nn

from . import _names
from ._names import loaded_from as _loaded_from, recognised as _allowed
from .._util._errors import InputError
from .._util._text import escaped


# ------------------------------------------------------------ callable paths
def callable_path(obj: Any) -> str | None:
    """``"package.module:qualname"`` for a function or class (or an instance's class)."""
    target = obj if (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)) else type(obj)
    mod = getattr(target, "__module__", None)
    qual = getattr(target, "__qualname__", None)
    if not mod or not qual or "<" in qual or mod == "__main__":
        return None
    return f"{mod}:{qual}"


_LONGEST_NAME = 1000  # characters of a package.module:callable name read from a file (real ones: under 200)
_LONGEST_PATH = 4200  # of a script's path and name (PATH_MAX is 4096)


def resolve(path: str, *, what: str, trusted: bool, trust: Sequence[str] = ()) -> Any:
    """Import ``"package.module:callable"``.

    A name you gave (``trusted``) is imported and looked up as written. A name read from a file is a
    suggestion, judged by its name before anything is imported: in torch.nn's or torch.optim's own modules
    (``_names.torch_own``), or inside a package prefix you trust (``trust``), it is imported where Python
    finds installed code and must resolve to an ``nn.Module`` class (model or loss), an optimizer class, one of
    ``torch.nn.functional``'s losses, or (under a trusted prefix) a function of that package, reached without
    passing through another module; any other name raises :class:`_names.NeedsConfirmation`. No
    standard-library module, no dunder attribute, and never a ``__main__`` module, even trusted."""
    if not isinstance(path, str):
        raise InputError(f"{what} {path!r} is a {type(path).__name__}, not a 'package.module:callable' string")
    if not trusted and len(path) > (_LONGEST_PATH if _names.is_script(path) else _LONGEST_NAME):
        # shown whole it would be the whole line (and once more in the flag that confirms it): a real one is short
        raise InputError(f"the file names {what} {escaped(path[:80])!r}... of {len(path):,} characters, longer than "
                         "any name Python imports or path a file has: the capture is damaged or forged")
    if _names.is_script(path):
        return _from_script(path, what=what, trusted=trusted)
    flag = _FLAGS.get(what, "--model")
    if _names.is_session(path):
        raise InputError(f"{what} {path!r} was defined in a notebook or interactive session, which cannot be "
                           f"imported; put it in a module and pass {flag} package.module:{path.partition(':')[2]}")
    mod_name, sep, qual = path.partition(":")
    if not sep or not _dotted(mod_name) or not _dotted(qual):
        raise InputError(f"{what} {path!r} is not of the form package.module:callable")
    if _names.is_main_module(mod_name):
        raise InputError(f"{what} {path!r} is in {mod_name!r}, a program's __main__ module: importing it runs that "
                           f"program, so nanhunt never does; pass {flag} package.module:{_placeholder(flag)} naming "
                           "the module that defines it")
    prefix = False
    if not trusted:
        _vet_name(path, mod_name, qual, what)
        prefix = _names.trusted_by(mod_name, trust)
        if not prefix and not _names.torch_own(mod_name, what):
            if mod_name.partition(".")[0] == "torch":  # torch's own code, never the user's: nothing to confirm
                raise _refused(path, what, f"of torch, only {_TORCH_OWN.get(what, 'torch.nn')} are used unconfirmed")
            raise _names.NeedsConfirmation(
                f"the file names {what} {path!r}, which is not torch's own: nanhunt imports it and calls it with the "
                f"file's arguments only if you trust it; pass {flag} {path} to confirm", what=what, path=path)
    obj: Any = _import(mod_name, path, what=what, trusted=trusted)
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise InputError(f"{what} {path!r}: module {mod_name!r} has no attribute {part!r}") from e
        if not trusted and isinstance(obj, types.ModuleType):
            # torch.os, torch.builtins: a path through another module reaches anything
            raise _refused(path, what, f"{part!r} is another module ({obj.__name__!r}), not something of {mod_name!r}")
    if not callable(obj):
        raise InputError(f"{what} {path!r} is not callable")
    if trusted or _allowed(obj, what) or (
            prefix and inspect.isfunction(obj) and _names.trusted_by(getattr(obj, "__module__", None) or "", trust)):
        return obj
    # only a plain function of the named (non-torch) module is offered for confirmation: never a
    # builtin, a torch function or anything the name reached by another way
    own = (inspect.isfunction(obj) and getattr(obj, "__module__", None) == mod_name
           and mod_name.partition(".")[0] != "torch")
    fix = (f"if you trust it, pass {flag} {path} to confirm" if own and what in _FLAGS else
           f"pass {flag} package.module:{_placeholder(flag)} with your own" if what in _FLAGS
           else "rebuild it yourself")
    message = (f"the file names {what} {path!r}, which is {_kind(what)}: nanhunt does not call it "
               f"unconfirmed; {fix}")
    if own and what in _FLAGS:
        raise _names.NeedsConfirmation(message, what=what, path=path)
    raise InputError(message)


# what a file's name may choose unconfirmed, in words
_TORCH_OWN = {"model factory": "torch.nn's module classes", "loss function": "torch.nn's losses",
              "optimizer class": "torch.optim's optimizers"}


def _placeholder(flag: str) -> str:
    return {"--model": "factory", "--optimizer": "Class"}.get(flag, "fn")


def _from_script(path: str, *, what: str, trusted: bool) -> Any:
    """A name recorded by the path of the script that defined it (``/dir/train.py:my_loss``)."""
    file, _, qual = path.rpartition(":")
    flag = _FLAGS.get(what, "--model")
    if not trusted:
        raise _names.NeedsConfirmation(
            f"the file names {what} {path!r}, defined in a script: nanhunt runs the script's imports and "
            f"definitions (never its loops or main block) only if you trust it; pass {flag} {path} to confirm"
            f"{_names.confirming([path])}", what=what, path=path)
    if not _dotted(qual):
        raise InputError(f"{what} {path!r} is not of the form /path/script.py:name")
    obj: Any = _names.load_script(file, qual.partition(".")[0])  # what this name needs of the script
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise InputError(f"{what} {path!r}: script {file!r} defines no {part!r} at its top level") from e
    if not callable(obj):
        raise InputError(f"{what} {path!r} is not callable")
    return obj


_FLAGS = _names.FLAGS


def _dotted(name: str) -> bool:
    return bool(name) and all(p.isidentifier() and not keyword.iskeyword(p) for p in name.split("."))


def _kind(what: str) -> str:
    return {"model factory": "not an nn.Module class",
            "optimizer class": "not a torch.optim.Optimizer class"}.get(
        what, "neither an nn.Module class nor one of torch.nn.functional's losses")


def _refused(path: str, what: str, why: str) -> InputError:
    flag = _FLAGS.get(what)
    fix = f"pass {flag} package.module:{_placeholder(flag)} with your own" if flag else "rebuild it yourself"
    return InputError(f"the file names {what} {path!r}, which nanhunt refuses: {why}; the file may be "
                        f"hostile; {fix}")


def _vet_name(path: str, mod_name: str, qual: str, what: str) -> None:
    """What can be said of a name from a file before anything is imported."""
    dunder = next((p for p in qual.split(".") if p.startswith("__")), None)
    if dunder:
        raise _refused(path, what, f"{dunder!r} is a Python internal")
    top = mod_name.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "__main__":
        raise _refused(path, what, f"{top!r} is Python's own module, which holds no "
                                   f"{'loss' if what == 'loss function' else 'model or optimizer'}")


def _find(mod_name: str) -> ModuleSpec | None:
    """The spec of ``mod_name`` found without running any of its packages' ``__init__``."""
    parts = mod_name.split(".")
    spec: ModuleSpec | None = None
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None) or ModuleSpec(name, None)
            if loaded.__dict__.get("__path__") is not None:
                spec.submodule_search_locations = list(loaded.__path__)
            continue
        if i == 0:
            try:
                spec = importlib.util.find_spec(name)  # a top-level name: nothing is executed
            except (ImportError, ValueError):
                return None
        else:
            where = None if spec is None else spec.submodule_search_locations
            if not where:
                return None  # the parent is a plain module, not a package
            spec = importlib.machinery.PathFinder.find_spec(name, list(where))
        if spec is None:
            return None
    return spec


def _import(mod_name: str, path: str, *, what: str, trusted: bool) -> Any:
    """Import ``mod_name``. A name you gave is looked up in the current directory too; a name read
    from a file (torch's own, or under a prefix you trust) only where Python finds installed code
    (site-packages, PYTHONPATH): importing a module runs it, and the current directory may hold a
    ticket's model.py or your own train.py."""
    if mod_name in sys.modules:
        return sys.modules[mod_name]  # imported already: nothing runs
    saved = list(sys.path)
    cwd = os.path.realpath(os.getcwd())
    top = mod_name.partition(".")[0]
    flag = _FLAGS.get(what, "--model")
    refused = _names.NeedsConfirmation(
        f"the file names {what} {path!r}, whose module is in the current directory, not installed: importing it "
        f"runs that code; pass {flag} {path} to confirm you trust it, or install its package", what=what, path=path)
    if trusted:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    else:
        # PYTHONPATH entries you set are trusted; a relative one ('.') would follow the directory
        # nanhunt runs in, so only absolute ones count.
        explicit = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if os.path.isabs(p)}
        if cwd not in explicit:
            if _loaded_from(sys.modules.get(top)) == cwd:  # a submodule of a package imported from here
                raise refused
            sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != cwd]
    try:
        if not trusted and _find(mod_name) is None:  # found missing before any package's __init__ runs
            raise ModuleNotFoundError(f"no module named {mod_name!r}", name=top if _find(top) is None else mod_name)
        return importlib.import_module(mod_name)
    except Exception as e:
        if not trusted and isinstance(e, ModuleNotFoundError) and e.name == top and (
                os.path.exists(os.path.join(cwd, top + ".py")) or os.path.isdir(os.path.join(cwd, top))):
            raise refused from e
        fix = "run from the project directory or install its package" if trusted else \
            "install its package or put it on PYTHONPATH"
        raise InputError(f"cannot import {what} module {mod_name!r} ({type(e).__name__}: {e}); {fix}") from e
    finally:
        if not trusted:
            sys.path[:] = saved
