"""A name read from a capture (model factory, loss, optimizer class) is judged by what it resolves to.

A capture attached to a ticket is untrusted: it may name any importable object, spelled any way. These tests
name hostile objects through every path nanhunt reads a name from (``resolve``, ``replay``, ``compare``) and
check that nothing runs, nothing is imported that need not be, and the refusal never suggests confirming a
hostile name.
"""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt._util._errors import InputError
from nanhunt.capture._names import FLAGS, NeedsConfirmation
from nanhunt.capture.capture import resolve
from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]

# Each of these resolves (through attributes torch re-exports) to something that runs a command, executes
# Python source, or reads / writes a file the capture picks.
HOSTILE_LOSSES = [
    "torch:os.system",
    "torch.nn.functional:torch.os.system",
    "torch:builtins.exec",
    "torch:builtins.eval",
    "torch:importlib.import_module",
    "torch:save",
    "torch:load",
    "torch:from_file",
    "torch.serialization:save",
    "torch.nn.functional:mse_loss.__globals__",
    "torch.nn.functional:__builtins__",
    "os:system",
    "builtins:exec",
    "subprocess:run",
    "subprocess:Popen",
]
HOSTILE_CLASSES = [
    "torch:os.system",
    "subprocess:Popen",
    "builtins:type",
    "torch.nn.modules.linear:Linear.__class__",
    "torch.nn:Module.__subclasses__",
    "torch:nn.Linear",  # a legitimate class, reached through an attribute that is a module
]


@pytest.mark.parametrize("name", HOSTILE_LOSSES)
def test_hostile_loss_names_are_refused(name: str) -> None:
    # GIVEN a loss name read from a capture  WHEN it is resolved untrusted  THEN it is refused
    with pytest.raises(InputError) as e:
        resolve(name, what="loss function", trusted=False)
    # AND the refusal never suggests confirming that name
    assert f"--loss {name}" not in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("what", ["model factory", "optimizer class"])
@pytest.mark.parametrize("name", HOSTILE_CLASSES)
def test_hostile_class_names_are_refused(name: str, what: str) -> None:
    with pytest.raises(InputError) as e:
        resolve(name, what=what, trusted=False)
    assert f"--model {name}" not in str(e.value)


@pytest.mark.parametrize("name, what, expected", [
    ("torch.nn.functional:mse_loss", "loss function", F.mse_loss),
    ("torch.nn.functional:cross_entropy", "loss function", F.cross_entropy),
    ("torch.nn.modules.loss:MSELoss", "loss function", nn.MSELoss),
    ("torch.nn.modules.linear:Linear", "model factory", nn.Linear),
    ("torch.optim.adamw:AdamW", "optimizer class", torch.optim.AdamW),
    ("torch.optim.sgd:SGD", "optimizer class", torch.optim.SGD),
])
def test_what_a_capture_writes_still_resolves(name: str, what: str, expected: Any) -> None:
    # GIVEN the names save_capture writes for torch's own losses, models and optimizers
    # THEN they resolve, untrusted, to exactly those objects
    assert resolve(name, what=what, trusted=False) is expected


@pytest.mark.subprocess
def test_a_stdlib_module_is_refused_before_it_is_imported() -> None:
    # GIVEN a capture naming a class in a standard-library module that runs code when imported
    # (antigravity opens a web browser), not imported yet
    code = ("import sys; from nanhunt.capture.capture import resolve; from nanhunt._util._errors import InputError\n"
            "try:\n    resolve('antigravity:Net', what='model factory', trusted=False)\n"
            "except InputError as e:\n    print('refused', e)\n"
            "print('imported' if 'antigravity' in sys.modules or 'webbrowser' in sys.modules else 'not imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "BROWSER": "true"}).stdout
    # THEN it is refused and the module was never imported
    assert "refused" in out and out.strip().endswith("not imported"), out


def test_a_missing_module_is_found_missing_without_running_its_parent(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN an installed package you trust whose __init__ has a side effect, and a capture naming a submodule it
    # lacks
    lib = tmp_path / "lib"
    (lib / "nhsec_parent").mkdir(parents=True)
    marker = tmp_path / "PARENT_RAN"
    (lib / "nhsec_parent" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setattr(sys, "path", [str(lib), *sys.path])
    monkeypatch.chdir(tmp_path)
    # WHEN it is resolved untrusted
    with pytest.raises(InputError, match="no module"):
        resolve("nhsec_parent.missing:Net", what="model factory", trusted=False, trust=("nhsec_parent",))
    # THEN the package's __init__ never ran
    assert not marker.exists()
    sys.modules.pop("nhsec_parent", None)


def test_a_users_own_loss_function_may_be_confirmed_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN the user's installed package with a plain loss function (not a torch loss, not a class)
    lib = tmp_path / "lib"
    (lib / "nhsec_proj").mkdir(parents=True)
    (lib / "nhsec_proj" / "__init__.py").write_text("")
    (lib / "nhsec_proj" / "losses.py").write_text("def focal(a, b):\n    return (a - b).abs().mean()\n")
    monkeypatch.setattr(sys, "path", [str(lib), *sys.path])
    monkeypatch.chdir(tmp_path)
    # WHEN a capture names it  THEN it is not called unconfirmed, and the message says how to confirm it
    with pytest.raises(InputError, match="--loss nhsec_proj.losses:focal"):
        resolve("nhsec_proj.losses:focal", what="loss function", trusted=False)
    # AND confirmed on the command line, it resolves
    assert resolve("nhsec_proj.losses:focal", what="loss function", trusted=True).__name__ == "focal"
    for name in [n for n in sys.modules if n.startswith("nhsec_proj")]:
        del sys.modules[name]


def _hostile_capture(tmp_path: Path, *, loss: str, command: str) -> list[str]:
    """A capture whose model passes its input through (Identity) and whose loss is ``loss``: if nanhunt
    called it, ``loss(command)`` would run with the file's string as argument."""
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=nn.Identity(), batch=torch.zeros(2))
    c = torch.load(ck, weights_only=True)
    c["loss_fn"] = loss
    torch.save(c, ck)
    b = torch.load(bt, weights_only=True)
    b["inputs"] = command
    torch.save(b, bt)
    return [str(ck), str(bt)]


@pytest.mark.parametrize("command", ["replay", "compare"])
@pytest.mark.parametrize("loss", ["torch:os.system", "torch.nn.functional:torch.os.system"])
def test_a_hostile_capture_runs_nothing_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        command: str, loss: str) -> None:
    # GIVEN a capture whose loss resolves to os.system and whose batch is a shell command
    marker = tmp_path / "PWNED"
    files = _hostile_capture(tmp_path, loss=loss, command=f"touch {marker}")
    # WHEN it is replayed (or compared) with no flag
    code = main([command, *files])
    # THEN nothing ran: exit 2 with one error line that does not offer to confirm the name
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert not marker.exists()
    assert len(err) == 1 and loss in err[0] and f"--loss {loss}" not in err[0], err


# ------------------------------------------------------------------ names outside torch's own are suggestions
# An installed library's nn.Module class is code too: its constructor runs with the file's arguments (torchmetrics'
# CLIPScore loads a model_name_or_path with remote code on). Each module here writes a marker when imported and
# its class another when built, so a test sees whether either ran.
LIB_NETS = ("import os, torch\nopen(os.path.join({where!r}, 'IMPORTED-' + __name__), 'w').close()\n"
            "class Net(torch.nn.Module):\n"
            "    def __init__(self, d=4):\n"
            "        super().__init__()\n"
            "        open(os.path.join({where!r}, 'BUILT-' + __name__), 'w').close()\n"
            "        self.fc = torch.nn.Linear(d, d)\n"
            "    def forward(self, x):\n"
            "        return self.fc(x)\n"
            "class Loss(torch.nn.Module):\n"
            "    def forward(self, out, y):\n"
            "        return ((out - y) ** 2).mean()\n"
            "class Lion(torch.optim.SGD):\n"
            "    pass\n")


@pytest.fixture(autouse=True)
def _no_team_trust(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule as a user meets it: no package prefix trusted by the environment."""
    monkeypatch.delenv("NANHUNT_TRUST_NAMES", raising=False)


@pytest.fixture()
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed library (``nhsec_lib``, and ``nhsec_libevil`` beside it) as site-packages would hold it: on
    sys.path, not in the current directory, not on PYTHONPATH. Yields the directory its markers go to."""
    site, marks = tmp_path / "site", tmp_path / "marks"
    marks.mkdir()
    for pkg in ("nhsec_lib", "nhsec_libevil"):
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("")
        (site / pkg / "nets.py").write_text(LIB_NETS.format(where=str(marks)))
    (site / "nhsec_lib" / "__main__.py").write_text(f"open({str(marks / 'MAIN-RAN')!r}, 'w').close()\nNet = 1\n")
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    yield marks
    for name in [n for n in sys.modules if n.partition(".")[0] in ("nhsec_lib", "nhsec_libevil")]:
        del sys.modules[name]


def _ran(marks: Path) -> list[str]:
    return sorted(p.name for p in marks.iterdir())


def _lib_capture(tmp_path: Path, *, factory: str = "nhsec_lib.nets:Net", loss: str | None = "nhsec_lib.nets:Loss",
                 optimizer: str | None = None) -> list[str]:
    """A capture of ``nn.Linear(4, 4)``'s weights under ``factory`` (keys ``fc.*``), its loss and optimizer class
    renamed as a hostile file would name them."""
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nanhunt.save_capture(ck, bt, model=model, batch=(torch.ones(2, 4), torch.zeros(2, 4)), loss_fn=F.mse_loss,
                         optimizer=opt)
    c = torch.load(ck, weights_only=True)
    c.update(model_factory=factory, loss_fn=loss, model_kwargs={"d": 4})
    if optimizer is not None:
        c["optimizer_class"] = optimizer
    torch.save(c, ck)
    return [str(ck), str(bt)]


@pytest.mark.parametrize("name, what, flag", [
    ("nhsec_lib.nets:Net", "model factory", "--model"),
    ("nhsec_lib.nets:Loss", "loss function", "--loss"),
    ("nhsec_lib.nets:Lion", "optimizer class", "--optimizer"),
])
def test_an_installed_librarys_class_is_neither_imported_nor_built_unconfirmed(lib: Path, name: str, what: str,
                                                                                flag: str) -> None:
    # GIVEN a capture naming an nn.Module (or optimizer) class of an installed library that is not torch's own
    # WHEN it is resolved unconfirmed
    with pytest.raises(NeedsConfirmation) as e:
        resolve(name, what=what, trusted=False)
    # THEN its module was not even imported, and the one line says the flag that confirms it
    assert _ran(lib) == [] and "nhsec_lib.nets" not in sys.modules
    assert f"pass {flag} {name} to confirm" in str(e.value) and "\n" not in str(e.value)
    # AND confirmed, it resolves
    assert resolve(name, what=what, trusted=True).__name__ == name.rpartition(":")[2]


@pytest.mark.parametrize("name, what, module", [
    ("torchmetrics.multimodal.clip_score:CLIPScore", "loss function", "torchmetrics.multimodal.clip_score"),
    ("transformers.models.gpt2.modeling_gpt2:GPT2MLP", "model factory", "transformers.models.gpt2.modeling_gpt2"),
])
def test_real_installed_libraries_need_confirmation(name: str, what: str, module: str) -> None:
    # GIVEN a capture naming a real library's nn.Module class (CLIPScore fetches and trusts remote code)
    pytest.importorskip(module.partition(".")[0])
    before = module in sys.modules
    # WHEN it is resolved unconfirmed  THEN it needs a confirmation, and was not imported for it
    with pytest.raises(NeedsConfirmation, match=f"pass {FLAGS[what]} {name} to confirm"):
        resolve(name, what=what, trusted=False)
    assert (module in sys.modules) == before


def test_a_replay_naming_a_librarys_classes_lists_every_confirmation(lib: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture whose model, loss and optimizer are an installed library's classes
    files = _lib_capture(tmp_path, optimizer="nhsec_lib.nets:Lion")
    # WHEN it is replayed with no flag
    code = main(["replay", *files, "--no-bisect"])
    # THEN exit 2, one line naming the three confirmations, and nothing was imported or built
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert ("pass --model nhsec_lib.nets:Net --loss nhsec_lib.nets:Loss --optimizer nhsec_lib.nets:Lion"
            in err[0]), err
    assert _ran(lib) == []
    # WHEN it is replayed with them  THEN it runs (finite: exit 0) with the library's classes
    code = main(["replay", *files, "--no-bisect", "--model", "nhsec_lib.nets:Net", "--loss", "nhsec_lib.nets:Loss",
                 "--optimizer", "nhsec_lib.nets:Lion"])
    assert code == 0, capsys.readouterr().err
    assert _ran(lib) == ["BUILT-nhsec_lib.nets", "IMPORTED-nhsec_lib.nets"]


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_trusted_package_prefix_confirms_its_names(lib: Path, tmp_path: Path, how: str,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a capture of the library's model, loss and optimizer, and that package trusted (by a flag, or by the
    # environment for a whole team)
    files = _lib_capture(tmp_path, optimizer="nhsec_lib.nets:Lion")
    if how == "flag":
        trust = ["--trust-names", "nhsec_lib"]
    else:
        trust = []
        monkeypatch.setenv("NANHUNT_TRUST_NAMES", "someone.other, nhsec_lib")
    # WHEN it is replayed  THEN its names are used with no other flag
    assert main(["replay", *files, "--no-bisect", *trust]) == 0, capsys.readouterr().err
    assert _ran(lib) == ["BUILT-nhsec_lib.nets", "IMPORTED-nhsec_lib.nets"]


@pytest.mark.parametrize("trust", ["nhsec_li", "nhsec_lib.net", "nhsec_lib.nets.Net"])
def test_a_trusted_prefix_matches_whole_components(lib: Path, tmp_path: Path, trust: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a trusted prefix that is not a whole package or module of the name (or names past its module)
    files = _lib_capture(tmp_path, loss=None)
    # WHEN the capture is replayed  THEN the name still needs its confirmation
    assert main(["replay", *files, "--no-bisect", "--trust-names", trust]) == 2
    assert "pass --model nhsec_lib.nets:Net to confirm" in capsys.readouterr().err
    assert _ran(lib) == []


def test_a_trusted_prefix_does_not_trust_a_longer_package_name(lib: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN nhsec_lib trusted, and a capture naming nhsec_libevil's class
    files = _lib_capture(tmp_path, factory="nhsec_libevil.nets:Net", loss=None)
    # WHEN it is replayed  THEN it is refused: nhsec_libevil is another package
    assert main(["replay", *files, "--no-bisect", "--trust-names", "nhsec_lib"]) == 2
    assert "pass --model nhsec_libevil.nets:Net to confirm" in capsys.readouterr().err
    assert _ran(lib) == []


@pytest.mark.parametrize("value", ["nhsec lib", "os", "torch", "nhsec_lib..nets"])
def test_a_trusted_prefix_must_be_a_package_name(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a prefix that is not a dotted name, or trusts the standard library or all of torch
    files = _hostile_capture(tmp_path, loss="torch.nn.functional:mse_loss", command="x")
    for how in ("flag", "environment"):
        monkeypatch.delenv("NANHUNT_TRUST_NAMES", raising=False)
        extra = ["--trust-names", value] if how == "flag" else []
        if how == "environment":
            monkeypatch.setenv("NANHUNT_TRUST_NAMES", value)
        # WHEN it is given  THEN exit 2, one line naming where the prefix came from
        code = main(["replay", *files, "--no-bisect", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert ("--trust-names" if how == "flag" else "NANHUNT_TRUST_NAMES") in err[0] and repr(value) in err[0]


@pytest.mark.parametrize("how", ["untrusted", "trusted prefix", "confirmed"])
def test_a_main_module_is_never_imported(lib: Path, how: str) -> None:
    # GIVEN a name in a package's __main__ module (importing it runs that program: certifi, tqdm, numpy.f2py)
    name = "nhsec_lib.__main__:Net"
    # WHEN it is resolved, even trusted  THEN it is refused and the module never ran
    with pytest.raises(InputError, match="a program's __main__ module") as e:
        resolve(name, what="model factory", trusted=how == "confirmed",
                trust=("nhsec_lib",) if how == "trusted prefix" else ())
    assert _ran(lib) == [] and "nhsec_lib.__main__" not in sys.modules
    assert f"--model {name}" not in str(e.value)


@pytest.mark.parametrize("name", ["tqdm.__main__:main", "numpy.f2py.__main__:main", "certifi.__main__:where"])
def test_real_main_modules_are_never_imported(name: str) -> None:
    # GIVEN a capture naming an installed program's __main__ (tqdm's reads stdin; f2py's parses sys.argv)
    # WHEN it is resolved, confirmed or not  THEN it is refused before anything is imported
    for trusted in (False, True):
        with pytest.raises(InputError, match="a program's __main__ module"):
            resolve(name, what="loss function", trusted=trusted)
    assert name.partition(":")[0] not in sys.modules


LINEAR = {"in_features": 2, "out_features": 2}
# names the tmp directory holds in place of the libraries nanhunt and torch import (each would write a marker)
SHADOWS = ("networkx", "rich", "typing_extensions", "numpy")


@pytest.mark.subprocess
@pytest.mark.parametrize("argv", [["--version"], ["replay", "CK", "BT", "--no-bisect"]],
                         ids=["version", "replay"])
def test_python_m_nanhunt_imports_nothing_from_the_current_directory(tmp_path: Path, argv: list[str]) -> None:
    # GIVEN a current directory holding networkx.py, rich.py, ... (an unpacked ticket) and a capture of torch's own
    # classes
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"open({str(tmp_path / ('RAN-' + name))!r}, 'w').close()\n")
    nanhunt.save_capture(tmp_path / "ck.pt", tmp_path / "bt.pt", model=nn.Linear(2, 2), model_kwargs=LINEAR,
                         batch=(torch.ones(1, 2), torch.ones(1, 2)), loss_fn=F.mse_loss)
    args = [{"CK": "ck.pt", "BT": "bt.pt"}.get(a, a) for a in argv]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANHUNT_TRUST_NAMES")}
    # WHEN nanhunt runs there as `python -m nanhunt` (as torchrun starts it) and as `python -mnanhunt`
    for m in (["-m", "nanhunt"], ["-mnanhunt"]):
        proc = subprocess.run([sys.executable, "-u", *m, *args], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=180)
        # THEN none of them ran, and the command did its work
        assert sorted(p.name for p in tmp_path.glob("RAN-*")) == [], proc.stderr[-2000:]
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_an_optimizer_defined_in_a_script_is_confirmed_by_optimizer(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture whose optimizer class was defined in the training script (recorded by the script's path)
    script = tmp_path / "train.py"
    script.write_text("import torch\nclass MyOpt(torch.optim.SGD):\n    pass\n")
    files = [str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt")]
    model = nn.Linear(2, 2)
    nanhunt.save_capture(files[0], files[1], model=model, model_kwargs=LINEAR,
                         batch=(torch.ones(1, 2), torch.ones(1, 2)),
                         loss_fn=F.mse_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    c = torch.load(files[0], weights_only=True)
    c["optimizer_class"] = f"{script}:MyOpt"
    torch.save(c, files[0])
    # WHEN it is replayed unconfirmed  THEN the one line names --optimizer, not --model
    assert main(["replay", *files, "--no-bisect"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"pass --optimizer {script}:MyOpt to confirm" in err and "--model" not in err, err
    # AND confirmed, the step replays with that optimizer (finite: exit 0)
    assert main(["replay", *files, "--no-bisect", "--optimizer", f"{script}:MyOpt"]) == 0, capsys.readouterr().err
    assert main(["compare", *files, "--optimizer", f"{script}:MyOpt"]) == 0, capsys.readouterr().err


@pytest.mark.subprocess
def test_a_huge_torch_nn_model_is_checked_on_meta_before_it_is_allocated(tmp_path: Path) -> None:
    # GIVEN a 2 KB capture naming torch.nn's Linear with 18000 x 18000 features (1.3 GB of float32) over a 4 x 4
    # weight
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    nanhunt.save_capture(ck, bt, model=nn.Linear(4, 4), batch=(torch.ones(1, 4), torch.ones(1, 4)),
                         loss_fn=F.mse_loss)
    c = torch.load(ck, weights_only=True)
    c["model_kwargs"] = {"in_features": 18000, "out_features": 18000}
    c["nn_model"] = None  # built from model_kwargs, not from the layers the capture describes
    torch.save(c, ck)
    assert ck.stat().st_size < 4096
    code = ("import sys\nfrom nanhunt.cli import main\n"
            f"code = main(['replay', {str(ck)!r}, {str(bt)!r}, '--no-bisect'])\n"
            # its own peak (VmHWM, kB): its rusage would start at the size of the pytest process it came from
            "print(code, next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n")
    # WHEN it is replayed
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    # THEN exit 2 with one line naming the shapes, and the process never held the weight (peak under 1 GiB)
    exit_code, peak_kib = map(int, proc.stdout.split())
    err = proc.stderr.strip().splitlines()
    assert exit_code == 2 and len(err) == 1, proc.stderr[-2000:]
    assert "shape mismatch weight (4, 4) vs (18000, 18000)" in err[0], err
    assert peak_kib < 1024 * 1024, peak_kib


def test_the_guards_command_confirms_every_name_outside_torchs_own(lib: Path) -> None:
    from nanhunt.capture._names import confirmations

    # GIVEN a run whose model, loss and optimizer are an installed library's, beside torch's own
    importlib.import_module("nhsec_lib.nets")
    nets = sys.modules["nhsec_lib.nets"]
    named = [("model factory", "nhsec_lib.nets:Net", nets.Net), ("loss function", "nhsec_lib.nets:Loss", nets.Loss),
             ("optimizer class", "nhsec_lib.nets:Lion", nets.Lion)]
    torch_own = [("model factory", "torch.nn.modules.linear:Linear", nn.Linear),
                 ("loss function", "torch.nn.functional:mse_loss", F.mse_loss),
                 ("optimizer class", "torch.optim.adamw:AdamW", torch.optim.AdamW)]
    # THEN the printed command confirms each of the library's names, and none of torch's
    assert confirmations(named) == (["--model", "nhsec_lib.nets:Net", "--loss", "nhsec_lib.nets:Loss",
                                     "--optimizer", "nhsec_lib.nets:Lion"], [])
    assert confirmations(torch_own) == ([], [])


def test_the_guards_printed_command_replays_a_librarys_model(lib: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a Guard over an installed library's model, loss and optimizer, stopped by a NaN in the batch
    nets: Any = importlib.import_module("nhsec_lib.nets")
    torch.manual_seed(0)
    model, loss_fn = nets.Net(d=4), nets.Loss()
    opt = nets.Lion(model.parameters(), lr=0.1)
    guard = nanhunt.Guard(model, opt, None, dump_dir=tmp_path / "nan", loss_fn=loss_fn, model_kwargs={"d": 4})
    x, y = torch.ones(2, 4), torch.zeros(2, 4)
    x[0, 0] = float("nan")
    with pytest.raises(nanhunt.GuardError) as e:
        with guard.step((x, y)):
            opt.zero_grad()
            guard.loss(loss_fn(model(x), y)).backward()
            opt.step()
    # THEN its printed command confirms the three names
    command = e.value.event.replay_command()
    assert command.endswith(" --model nhsec_lib.nets:Net --loss nhsec_lib.nets:Loss "
                            "--optimizer nhsec_lib.nets:Lion"), command
    # AND run as printed, it replays the step and finds the NaN (exit 1)
    capsys.readouterr()
    assert main([*shlex.split(command)[1:], "--no-bisect"]) == 1, capsys.readouterr().err
