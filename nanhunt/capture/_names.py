"""Names of the user's own code in a capture: what the file records, and what its replay needs confirmed.

A model class or loss function defined in the script that trains (``__main__``) has no importable name. The
capture records it by the script's absolute path (``/home/me/train.py:my_loss``), with how the script was started
(field ``script``: its argv, working directory, path and the sha256 of its text, :func:`script_run`). The replay
imports it only when you confirm that name (``--loss /home/me/train.py:my_loss``), and then runs, in the script's
order, in a module of its own (:func:`load_script`):

- the script's imports (the modules they import run) and its inert statements: function and class definitions,
  assignments, and ``if`` / ``try`` blocks of these, that call none of the script's code and read only names
  imports, builtins or other inert statements bind (``EPS = 1e-6``; :func:`._slice._inert` says what they may
  hold: a decorator or metaclass imported from a library, ``@dataclass(frozen=True)``, but no call anywhere else,
  annotations included);
- and the module-level statements these or the confirmed name need, found by the names they read (a def-use
  slice): an assignment or definition, whatever it calls, of a name that a statement that runs reads as it runs
  (``HIDDEN = args.hidden`` for ``def __init__(self, hidden=HIDDEN)``) or that the confirmed name, or anything
  it needs, reads when called (``args`` in ``my_loss``'s body), transitively (``args = parser.parse_args()``,
  then ``parser = ...``); a method called as a statement on such a name, or an attribute or item assigned on it
  (``parser.add_argument(...)``, ``args.lr *= 2``), never on an imported module (``torch.manual_seed(0)`` does
  not run); an ``if`` / ``try`` block (not the main block) made only of such statements and definitions, whole,
  test included, when it assigns or changes a needed name. A comprehension counts as an expression.

It never runs a loop, a ``with`` or ``match`` block, ``del``, ``assert``, a plain call as a statement
(``fit(model)``, ``main()``), the ``if __name__ == "__main__":`` block, or a statement nothing needs
(``model = Net()``, unless a statement that runs reads ``model``), so confirming the name does not train again
(what runs may still register an ``atexit`` function). While it runs, ``sys.argv`` is the argv the capture
recorded for that script's path (without one: the script's path alone, so its defaults), the working directory
is the script's own (where the capture recorded one: a file does not choose where your statements read and
write), the script's directory is first on the import path, and what it prints goes to stderr; all of them are
put back after. The script compiles with its own ``__future__`` imports, not this module's. The message asking
you to confirm the name shows that argv, whole, and directory, and the replay says them in a note. A script
whose sha256 differs from the recorded one is run as it is now, and the replay says so in a note. argparse's
exit on an argv the script no longer parses, and any failure, is one error line; a name that the slice cannot
assign is named with where the script assigns it. The Guard, when it is made, reads the same slice, running none
of it, and warns when the replay would lack a name (:func:`replay_problem`).
A name defined in a notebook or an interactive session cannot be imported at all: it is recorded as
``__main__:name`` and the replay asks for your own module's.

:func:`torch_own` is the rule for a name read from a file, judged by the name before anything is imported:
torch.nn's own module classes (a model or a loss), torch.nn.functional's losses and torch.optim's optimizers
are used as the file says; any other name is a suggestion, used only when you confirm it (``--model`` /
``--loss`` / ``--optimizer``) or trust its package (:func:`trusted_prefixes`).

:func:`confirmations` tells, when the capture is written, which of its names a replay will refuse unconfirmed:
the Guard prints its replay command with those flags, so that the command works as printed.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib.util
import inspect
import io
import json
import keyword
import os
import re
import shlex
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._util._errors import InputError, first_line, visible
from ._slice import ELSEWHERE, MODULE_NAMES, RUNS_ONLY, def_use_slice, where_set

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


class NeedsConfirmation(InputError):
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
                raise InputError(f"{source} {v!r} {why}; name your own package's prefix")
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


@dataclass(frozen=True)
class ScriptRun:
    """How the training script was started, as a capture recorded it (field ``script``): what its module-level
    statements read when the replay runs them again."""

    path: str
    argv: tuple[str, ...]
    cwd: str | None
    sha256: str | None


_MAX_ARGV = 10_000  # arguments, and characters in all of them: more than any command line holds
_MAX_ARGV_CHARS = 1 << 20
_RECORDED: ContextVar[tuple[ScriptRun | None, list[str]] | None] = ContextVar("nanhunt_script_run", default=None)


def script_run(names: Iterable[str | None]) -> dict[str, Any] | None:
    """A capture's field ``script``: for a capture naming something the running script (``__main__``) defines,
    its path, argv, working directory and the sha256 of its text; None for any other capture."""
    file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(file, str) or not file.endswith(".py"):
        return None
    path = os.path.abspath(file)
    if not any(isinstance(n, str) and is_script(n) and n.rpartition(":")[0] == path for n in names):
        return None
    return {"path": path, "argv": [str(a) for a in sys.argv], "cwd": os.getcwd(), "sha256": _sha256(path)}


def _sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _read_run(ck: Any, where: str) -> ScriptRun | None:
    """The capture's field ``script``, checked (it comes from the file): an absolute ``.py`` path, an argv of at
    most :data:`_MAX_ARGV` strings, an absolute directory or null, a sha256 or null."""
    value = ck.get("script") if isinstance(ck, Mapping) else None
    if value is None:
        return None
    path, argv, cwd, digest = (value.get(k) for k in ("path", "argv", "cwd", "sha256")) if isinstance(
        value, Mapping) else (None, None, None, None)
    ok = (isinstance(path, str) and os.path.isabs(path) and path.endswith(".py") and "\0" not in path
          and isinstance(argv, list) and len(argv) <= _MAX_ARGV and all(isinstance(a, str) for a in argv)
          and sum(map(len, argv)) <= _MAX_ARGV_CHARS
          and (cwd is None or isinstance(cwd, str) and os.path.isabs(cwd) and "\0" not in cwd)
          and (digest is None or isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest) is not None))
    if not ok:
        raise InputError(f"{where} is not a valid nanhunt capture: field 'script' is not a script's absolute path, "
                           "argv, working directory and sha256; save the capture again")
    assert isinstance(path, str) and isinstance(argv, list)
    return ScriptRun(path, tuple(argv), cwd, digest)


@contextmanager
def recorded(ck: Any, where: str, notes: list[str]) -> Iterator[None]:
    """While the step of the capture ``ck`` is built: the run of its script it recorded (field ``script``,
    checked) is the one :func:`load_script` runs that script's definitions with; ``notes`` hears if the script
    changed since."""
    token = _RECORDED.set((_read_run(ck, where), notes))
    try:
        yield
    finally:
        _RECORDED.reset(token)


def load_script(file: str, name: str | None = None) -> types.ModuleType:
    """The definitions of the script ``file`` that ``name`` needs, as a module (see the module docstring): run
    with the argv its capture recorded (:func:`recorded`), in the script's own directory, both said in a note;
    else with no arguments; loaded once per path, name and run.

    Only for a name you confirmed: its imports and definitions run."""
    path = os.path.abspath(file)
    run, notes = _recorded_run(path)
    argv = list(run.argv) if run is not None else [path]
    cwd = _run_dir(run) if run is not None else None
    key = "_nanhunt_script_" + hashlib.sha1(json.dumps([path, name, argv, cwd]).encode()).hexdigest()[:12]
    if not os.path.isfile(path):
        raise InputError(f"script {file!r} does not exist; run from where it was captured or pass the "
                           "name as package.module:name")
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise InputError(f"cannot read script {file!r} ({type(e).__name__}: {e})") from e
    changed = run is not None and run.sha256 is not None and hashlib.sha256(text).hexdigest() != run.sha256
    if changed and notes is not None:
        note = (f"script {path} changed since the capture (its sha256 differs): its definitions ran as they are "
                "now, with the argv the capture recorded")
        if note not in notes:
            notes.append(note)
    if run is not None and notes is not None:  # what the file chose for the script you confirmed, said
        note = f"script {path}'s definitions ran {_run_words(run)}"
        if note not in notes:
            notes.append(note)
    loaded = sys.modules.get(key)
    if loaded is not None:
        return loaded
    said = (f"with the argv its capture recorded ({_argv_text(argv)})" if run is not None else
            "with no arguments (its capture recorded none)")
    return _run(path, text, name, argv, cwd, key, said=said, changed=changed)


def _recorded_run(path: str) -> tuple[ScriptRun | None, list[str] | None]:
    """The run of the script ``path`` that the capture being read recorded (:func:`recorded`), if any, and the
    replay's notes."""
    got = _RECORDED.get()
    run, notes = got if got is not None else (None, None)
    return (run if run is not None and run.path == path else None), notes


def _run_dir(run: ScriptRun) -> str | None:
    """Where a recorded run's definitions run: the script's own directory, whatever directory the capture names
    (a file does not choose where the statements you confirm read and write); None: no directory was recorded,
    so here."""
    return None if run.cwd is None else os.path.dirname(run.path)


def _run_words(run: ScriptRun) -> str:
    """The argv and directory a recorded run's definitions run with, in words."""
    where = _run_dir(run)
    text = f"with the argv its capture recorded ({_argv_text(run.argv)})"
    if where is None:
        return text + " in the current directory"
    if run.cwd is not None and os.path.realpath(run.cwd) != os.path.realpath(where):
        return text + f" in its own directory {visible(where)}, not in {visible(run.cwd)} where the capture says it " \
                      "was started"
    return text + f" in {visible(where)}"


def confirming(names: Iterable[str]) -> str:
    """What the script among ``names`` runs with once you confirm it, for the message that asks you to: the argv
    and directory its capture recorded; empty when the capture being read recorded no run of it."""
    for name in names:
        if is_script(name):
            run, _ = _recorded_run(os.path.abspath(name.rpartition(":")[0]))
            if run is not None:
                return f"; confirmed, it runs {_run_words(run)}"
    return ""


def replay_problem(name: str, what: str) -> str | None:
    """Why the confirmed replay of the script name ``name`` would fail, read from the script's slice without
    running any of it: ``name`` is not defined at the script's top level, or something the slice needs is
    assigned by no statement the replay runs; None when nothing is wrong, or when only running the script would
    tell (a star import, ``globals()``, ``exec``). For the Guard when it is made: the training it guards draws
    the same random numbers, and its module-level statements run once, as without nanhunt."""
    file, _, qual = name.rpartition(":")
    path, root = os.path.abspath(file), qual.partition(".")[0]
    head = f"the printed replay command will fail on {what} {name}: "
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
        plan = def_use_slice(tree, root)
    except OSError as e:
        return head + f"cannot read script {file!r} ({type(e).__name__}: {e})"
    except (SyntaxError, ValueError) as e:
        return head + f"cannot read script {path!r} ({type(e).__name__}: {e})"
    except Exception as e:  # a failure of nanhunt's own reading: said, and the training it guards goes on
        return f"nanhunt could not check that the printed replay command works for {what} {name}: {first_line(e)}"
    if _opaque(plan.body):
        return None
    if root not in plan.bound:
        return head + f"script {file!r} defines no {root!r} at its top level; {ELSEWHERE}"
    missing = sorted(n for n in plan.needed - plan.set_later - plan.bound - {root}
                     if n not in MODULE_NAMES and not hasattr(builtins, n))
    if not missing:
        return None
    return head + (f"it uses {missing[0]!r}, which the script assigns {where_set(tree, missing[0])}; {RUNS_ONLY}: "
                   f"assign {missing[0]} at the module level, or put {root} in a module")


# calls that bind module-level names no statement names
_OPAQUE = frozenset({"globals", "vars", "locals", "exec", "eval"})


def _opaque(body: list[ast.stmt]) -> bool:
    """The names these statements bind are known only by running them: a star import, or a use of ``globals()``,
    ``vars()``, ``locals()``, ``exec`` or ``eval``."""
    return any(isinstance(n, ast.Name) and n.id in _OPAQUE
               or isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)
               for node in body for n in ast.walk(node))


_ARGV_LONG = 2000  # characters past which a shown argv says its size before it


def _argv_text(argv: Iterable[str]) -> str:
    """An argv as a command line, its control characters escaped: what a file recorded, shown to be confirmed.
    Always whole, every argument to its last character: a cut could hide the argument that acts
    (``--log /victim`` after padding). A long one first says how many arguments and characters it holds, so
    that whoever confirms it knows to read it to its end."""
    args = list(argv)
    text = visible(shlex.join(args))
    return text if len(text) <= _ARGV_LONG else f"{len(args)} arguments, {len(text)} characters, all shown: {text}"


def _run(path: str, text: bytes, name: str | None, argv: list[str], cwd: str | None, key: str, *, said: str,
         changed: bool) -> types.ModuleType:
    """Run the slice of the script ``path`` (its bytes ``text``) for ``name`` in a new module registered as
    ``key``: ``sys.argv`` is ``argv``, the directory ``cwd`` (where it still exists), the script's own directory
    first on the import path, what it prints goes to stderr; all of these are put back. A failure, argparse's
    exit included, is one :class:`InputError` line."""
    try:
        tree = ast.parse(text, filename=path)
        plan = def_use_slice(tree, name)
        # dont_inherit: the script's own __future__ imports decide how it compiles, not this module's
        code = compile(ast.Module(body=plan.body, type_ignores=[]), path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        raise InputError(f"cannot read script {path!r} ({type(e).__name__}: {e})") from e
    spec = importlib.util.spec_from_loader(key, loader=None, origin=path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = path
    since = "; the script changed since the capture" if changed else ""
    saved_path, saved_argv, here = list(sys.path), sys.argv, os.getcwd()
    # the script's own imports (a model.py beside it) first, as when it ran; a relative entry keeps meaning here
    sys.path[:] = [os.path.dirname(path), *(os.path.abspath(p) for p in saved_path)]
    sys.argv = argv
    sys.modules[key] = module  # dataclasses and pickling look their module up by name
    printed = io.StringIO()
    moved = False
    try:
        if cwd is not None and os.path.isdir(cwd):
            os.chdir(cwd)
            moved = True
        with redirect_stdout(printed), redirect_stderr(printed):
            exec(code, module.__dict__)
    except BaseException as e:  # a Ctrl-C too: a half-run module is never handed out later
        sys.modules.pop(key, None)
        if isinstance(e, SystemExit):  # argparse's error (its usage printed above it) or --help
            last = next((line for line in reversed(printed.getvalue().splitlines()) if line.strip()), None)
            raise InputError(f"running the definitions of script {path!r} {said} exited: "
                               f"{last or f'exit code {e.code}'}{since}; make the script parse that argv, or "
                               f"{ELSEWHERE}") from None
        if not isinstance(e, Exception):
            raise
        fix = (f"the script assigns {e.name!r} {where_set(tree, e.name)}; {RUNS_ONLY}: assign {e.name} at the "
               f"module level, or {ELSEWHERE}"
               if isinstance(e, NameError) and e.name else ELSEWHERE)
        raise InputError(f"running the definitions of script {path!r} raised {first_line(e)}{since}; {fix}") from e
    finally:
        if moved:
            os.chdir(here)
        sys.argv = saved_argv
        sys.path[:] = saved_path
    if printed.getvalue():
        sys.stderr.write(printed.getvalue())
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
        if (not is_script(name) and where is not None and where not in explicit and where in (_script_dir(), cwd)
                and "." not in mod and isinstance(file, str) and file.endswith(".py")):
            # beside the script (or here), not installed: its file finds it from any directory the command is
            # pasted in, its own imports (a layers.py beside it) from its folder
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
