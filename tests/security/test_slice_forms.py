"""A confirmed script runs only what docs/safety.md says: its imports, its inert statements (definitions and
assignments whose running calls nothing of the script's), and the statements a needed name reads.

The table gives one statement form per row, put after a prelude that defines ``target`` (the confirmed name, which
reads nothing) and ``train`` (the script's function that acts): the row's last statement either always runs
(inert) or is left out, since nothing ``target`` needs reads what it binds. Every way Python evaluates code in a
statement is a row: targets, subscripts, slices, except types, decorators, defaults, annotations, class bases,
keywords and bodies, metaclasses, comprehensions, lambdas, walrus, f-strings, match, del, loops, ``with``.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nanhunt.capture import _names
from nanhunt.capture._slice import def_use_slice
from nanhunt.capture.capture import save_capture
from nanhunt.cli import main as cli_main

_PRELUDE = """
import abc
import dataclasses
import sys
from dataclasses import dataclass
import torch
from torch import nn
REG = {}
EPS = 1e-6
def train():
    return 1
def target():
    return 0
"""

_NEW_SYNTAX = pytest.mark.skipif(sys.version_info < (3, 12), reason="PEP 695 syntax is Python 3.12's")

# (the statements after the prelude, whether the last one runs for ``target``)
FORMS = [
    # assignments: every part of them is evaluated
    ("EPS2 = 1e-6", True),
    ("REG['a'] = 1", True),
    ("REG[train()] = 1", False),
    ("REG[train()] += 1", False),
    ("REG['a'] += train()", False),
    ("REG[1:train()] = [1]", False),
    ("REG.x, REG[train()] = 1, 2", False),
    ("X = REG[train():]", False),
    ("X: int = 1", True),
    ("X: list[int] = []", True),
    ("X: train() = 1", False),
    ("X: 'train()' = 1", False),
    ("X: list['train()'] = []", False),
    ("X: train()", False),
    ("REG[train()]: int", False),
    ("X = (Y := 2)", True),
    ("X = (Y := train())", False),
    ("X = [(Y := train()) for i in (1,)]", False),
    ("X = [i * 2 for i in (1, 2)]", True),
    ("X = [i for i in train()]", False),
    ("X = {i: train() for i in (1,)}", False),
    ("X = (i for i in (1,) if train())", False),
    ("X = f'{EPS!r:>10}'", True),
    ("X = f'{train()}'", False),
    ("X = f'{EPS:{train()}}'", False),
    ("ACT = lambda x: train()", True),  # a lambda's body runs when it is called
    ("ACT = lambda x=train(): x", False),
    ("ACT = lambda *, x=train(): x", False),
    ("X = EPS * 2 if EPS else -EPS", True),
    ("X = sys.version_info >= (3, 8)", True),
    ("EPS3 = train()\nX = EPS3", False),  # reads what a statement that calls assigns
    ("REG.setdefault('a', train())\nX = REG", False),  # reads what a statement that calls changes
    ('"""a docstring"""', True),
    # blocks
    ("try:\n    import apex\nexcept ImportError:\n    apex = None", True),
    ("try:\n    import apex\nexcept (train() or ImportError):\n    apex = None", False),
    ("try:\n    import apex\nexcept ImportError as e:\n    apex = None\nfinally:\n    REG[train()] = 1", False),
    ("if sys.version_info >= (3, 8):\n    X = 1\nelse:\n    X = 2", True),
    ("if train():\n    X = 1", False),
    ("if True:\n    REG[train()] = 1", False),
    # statements that never run
    ("train()", False),
    ("REG.update(a=train())", False),
    ("for i in (1,):\n    X = i", False),
    ("while False:\n    X = 1", False),
    ("with open(__file__) as f:\n    X = 1", False),
    ("del REG['a']", False),
    ("assert train()", False),
    ("match REG:\n    case {'a': 1}:\n        X = 1", False),
    ("match REG:\n    case nn.Linear(in_features=2):\n        X = 1", False),
    ("match EPS:\n    case sys.maxsize:\n        X = 1", False),
    ('if __name__ == "__main__":\n    X = 1', False),
    # functions: decorators, defaults and annotations run when the def does, the body when it is called
    ("def g(x=1, *, y=(1, 2), z=EPS) -> int:\n    return train()", True),
    ("def g(x=train()):\n    pass", False),
    ("def g(*, x=train()):\n    pass", False),
    ("def g(x=lambda y=train(): y):\n    pass", False),
    ("def g(x=(W := train())):\n    pass", False),
    ("def g(x: train()):\n    pass", False),
    ("def g(*a: train()):\n    pass", False),
    ("def g() -> train():\n    pass", False),
    ("def g() -> 'train()':\n    pass", False),
    ("async def g(x=train()):\n    pass", False),
    ("@torch.no_grad()\ndef g():\n    return train()", True),
    ("@dataclasses.dataclass\nclass C:\n    a: int = 1", True),
    ("@train\ndef g():\n    pass", False),
    ("@train()\ndef g():\n    pass", False),
    ("@REG['deco']\ndef g():\n    pass", False),
    ("@(lambda f: train())\ndef g():\n    pass", False),
    ("@torch.no_grad(train())\ndef g():\n    pass", False),
    ("dataclass = train\n@dataclass\nclass C:\n    pass", False),  # an imported name the script rebinds
    ("def __getattr__(name):\n    return train()", False),  # runs on a lookup of the module
    ("def g():\n    global REG\n    REG = train()", True),
    # classes: decorators, bases, keywords and the body run when the class statement does
    ("@dataclass(frozen=True)\nclass C:\n    a: int = 1\n    b: tuple[int, ...] = (1, 2)", True),
    ("@dataclass(frozen=train())\nclass C:\n    pass", False),
    ("class C(nn.Module):\n    scale = 2.0\n    def forward(self, x):\n        return train()", True),
    ("class C:\n    @property\n    def x(self):\n        return train()\n    @x.setter\n    def x(self, v):\n"
     "        pass\n    @staticmethod\n    def s():\n        return train()", True),
    ("class C:\n    def x(self):\n        pass\n    @x\n    def y(self):\n        pass", False),
    ("def property(f):\n    return train()\nclass C:\n    @property\n    def x(self):\n        pass", False),
    ("class C(train()):\n    pass", False),
    ("class C(nn.Module, flag=train()):\n    pass", False),
    ("class C(**{'flag': train()}):\n    pass", False),
    ("class C(metaclass=abc.ABCMeta):\n    pass", True),
    ("class Meta(type):\n    pass\nclass C(metaclass=Meta):\n    pass", False),
    ("class C(metaclass=type(train)):\n    pass", False),
    ("class Base:\n    def __init_subclass__(cls):\n        train()\nclass C(Base):\n    pass", False),
    ("class Base:\n    def __class_getitem__(cls, k):\n        return train()\nX = Base[int]", False),
    ("class C:\n    x = train()", False),
    ("class C:\n    train()", False),
    ("class C:\n    x: train() = 1", False),
    ("class C:\n    for i in (1,):\n        pass", False),
    ("class C:\n    global REG\n    REG = train()", False),
    ("class C:\n    class D(train()):\n        pass", False),
    ("class C:\n    def m(self, x=train()):\n        pass", False),
    ("class C:\n    X = [i for i in train()]", False),
    ("class Base:\n    pass\nclass C(Base, metaclass=abc.ABCMeta):\n    pass", True),
    # PEP 695 (evaluated lazily, counted as evaluated)
    pytest.param("type X = list[int]", True, marks=_NEW_SYNTAX),
    pytest.param("type X = train()", False, marks=_NEW_SYNTAX),
    pytest.param("def g[T: train()]():\n    pass", False, marks=_NEW_SYNTAX),
    pytest.param("class C[T: train()]:\n    pass", False, marks=_NEW_SYNTAX),
]


@pytest.mark.parametrize(("form", "runs"), FORMS)
def test_each_statement_form_runs_only_when_it_calls_nothing_of_the_script(form: str, runs: bool) -> None:
    # GIVEN a script ending in the form, which nothing its confirmed name ``target`` needs reads
    tree = ast.parse(_PRELUDE + form + "\n")
    # WHEN its slice for target is taken
    body = def_use_slice(tree, "target").body
    # THEN the form runs only if it is inert, and the prelude's definitions all run
    assert (tree.body[-1] in body) is runs, ast.unparse(tree.body[-1])
    assert all(node in body for node in tree.body[:9])


@pytest.mark.parametrize("form", [
    "@train\nclass C:\n    pass",  # a decorator of the script's own
    "X = [(C := train()) for i in (1,)]",  # a walrus in a comprehension binds the module's C
    "class D:\n    global C\n    C = train()",  # a class body's global
    "def g(x=(C := train())):\n    pass",  # a walrus in a default
])
def test_a_form_a_needed_name_reads_runs_whatever_it_calls(form: str) -> None:
    # GIVEN a form that binds C calling the script's function, and a function that reads C when called
    tree = ast.parse(_PRELUDE + form + "\ndef use():\n    return C\n")
    # WHEN the slice for that function is taken
    # THEN the form runs, as a statement the confirmed name needs
    assert tree.body[-2] in def_use_slice(tree, "use").body


# A script that trains in every form above, each mark a line in a file; Net and the loss read nothing of it.
_HOSTILE = """
    import abc
    import dataclasses
    import torch
    from torch import nn

    REG = {{}}

    def mark(what):
        with open({marks!r}, "a") as f:
            f.write(what + "\\n")
        return what

    REG[mark("target")] = 1
    REG[mark("augmented target")] += 1
    X: mark("annotation") = 1
    Y: list[mark("annotation in a subscript")] = []
    try:
        import apex
    except (mark("except type") or ImportError):
        apex = None

    def hook_default(x=mark("default")):
        pass

    def hook_annotation(x: mark("def annotation")):
        pass

    @dataclasses.dataclass(frozen=bool(mark("decorator argument")))
    class Frozen:
        a: int = 1

    class Meta(type):
        def __new__(mcs, *a):
            mark("metaclass")
            return super().__new__(mcs, *a)

    class WithMeta(metaclass=Meta):
        pass

    class Base:
        def __init_subclass__(cls, **kw):
            mark("init_subclass")

    class Sub(Base):
        pass

    class Body:
        x = mark("class body")

    Z = [mark("comprehension") for _ in (1,)]
    W = (V := mark("walrus"))

    def __getattr__(name):
        return mark("module getattr " + name)

    @dataclasses.dataclass
    class Config:
        width: int = 2

    class Net(nn.Linear):
        def __init__(self, cfg: Config = Config()):
            super().__init__(cfg.width, 2)

    def my_loss(out, y):
        return ((out - y) ** 2).mean()

    if __name__ == "__main__":
        mark("main")
"""


def test_a_confirmed_script_replays_and_none_of_its_hidden_calls_run(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture naming a script's Net and loss, the script calling a function that marks a file in every
    # statement form but those Net needs
    marks = tmp_path / "marks.txt"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_HOSTILE.format(marks=str(marks))))
    files = [str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt")]
    save_capture(files[0], files[1], model=torch.nn.Linear(2, 2), batch=(torch.ones(1, 2), torch.ones(1, 2)),
                 loss_fn=torch.nn.MSELoss())
    ck = torch.load(files[0], weights_only=True)
    ck.update(model_factory=f"{script}:Net", loss_fn=f"{script}:my_loss",
              script={"path": str(script), "argv": [str(script)], "cwd": str(tmp_path), "sha256": None})
    torch.save(ck, files[0])
    # WHEN it is replayed, both names confirmed
    code = cli_main(["replay", *files, "--model", f"{script}:Net", "--loss", f"{script}:my_loss", "--no-bisect"])
    err = capsys.readouterr().err
    # THEN the step replayed (finite) and no mark was made
    assert code == 0, err
    assert not marks.exists(), marks.read_text()


def test_a_scripts_annotations_are_evaluated_as_the_script_says(tmp_path: Path) -> None:
    # GIVEN a script whose dataclass annotations are evaluated (no __future__ import), and one that defers them
    (tmp_path / "plain.py").write_text("import dataclasses\n@dataclasses.dataclass\nclass C:\n    a: int = 1\n")
    (tmp_path / "deferred.py").write_text("from __future__ import annotations\n" + (tmp_path / "plain.py").read_text())
    # WHEN each is loaded for C
    plain = _names.load_script(str(tmp_path / "plain.py"), "C")
    deferred = _names.load_script(str(tmp_path / "deferred.py"), "C")
    # THEN the first sees the type, the second the string, as when each script runs as itself
    assert plain.C.__annotations__ == {"a": int}
    assert deferred.C.__annotations__ == {"a": "int"}
