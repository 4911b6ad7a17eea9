"""A name read from a capture (model factory, loss, optimizer class) is judged by what it resolves to.

A capture attached to a ticket is untrusted: it may name any importable object, spelled any way. These tests
name hostile objects through every path nanhunt reads a name from (``resolve``, ``replay``, ``compare``) and
check that nothing runs, nothing is imported that need not be, and the refusal never suggests confirming a
hostile name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt._errors import CommandError
from nanhunt.capture import resolve
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
    with pytest.raises(CommandError) as e:
        resolve(name, what="loss function", trusted=False)
    # AND the refusal never suggests confirming that name
    assert f"--loss {name}" not in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("what", ["model factory", "optimizer class"])
@pytest.mark.parametrize("name", HOSTILE_CLASSES)
def test_hostile_class_names_are_refused(name: str, what: str) -> None:
    with pytest.raises(CommandError) as e:
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


def test_a_stdlib_module_is_refused_before_it_is_imported() -> None:
    # GIVEN a capture naming a class in a standard-library module that runs code when imported
    # (antigravity opens a web browser), not imported yet
    code = ("import sys; from nanhunt.capture import resolve; from nanhunt._errors import CommandError\n"
            "try:\n    resolve('antigravity:Net', what='model factory', trusted=False)\n"
            "except CommandError as e:\n    print('refused', e)\n"
            "print('imported' if 'antigravity' in sys.modules or 'webbrowser' in sys.modules else 'not imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "BROWSER": "true"}).stdout
    # THEN it is refused and the module was never imported
    assert "refused" in out and out.strip().endswith("not imported"), out


def test_a_missing_module_is_found_missing_without_running_its_parent(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN an installed package whose __init__ has a side effect, and a capture naming a submodule it lacks
    lib = tmp_path / "lib"
    (lib / "nhsec_parent").mkdir(parents=True)
    marker = tmp_path / "PARENT_RAN"
    (lib / "nhsec_parent" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setattr(sys, "path", [str(lib), *sys.path])
    monkeypatch.chdir(tmp_path)
    # WHEN it is resolved untrusted
    with pytest.raises(CommandError, match="no module"):
        resolve("nhsec_parent.missing:Net", what="model factory", trusted=False)
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
    with pytest.raises(CommandError, match="--loss nhsec_proj.losses:focal"):
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
