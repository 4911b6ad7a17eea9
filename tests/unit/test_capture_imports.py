"""Model factories of untrusted captures are never imported from the current directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from nanhunt._util._errors import InputError
from nanhunt.capture.capture import resolve

# ====================================================================== capture.resolve


@pytest.fixture
def _isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("nhtmp_"):
            del sys.modules[name]


def test_untrusted_submodule_of_a_cwd_package_already_imported_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_imports: None) -> None:
    # GIVEN the user's project directory with its own package (not installed): nhtmp_proj/losses.py and
    # nhtmp_proj/train.py (the training script's module: importing it runs it)
    pkg = tmp_path / "nhtmp_proj"
    pkg.mkdir()
    marker = tmp_path / "TRAIN_RAN"
    (pkg / "__init__.py").write_text("")
    (pkg / "losses.py").write_text("def mse(a, b):\n    return (a - b).pow(2).mean()\n")
    (pkg / "train.py").write_text(f"open({str(marker)!r}, 'w').close()\nimport torch\n"
                                  "class Opt(torch.optim.SGD):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    # WHEN `--loss nhtmp_proj.losses:mse` is confirmed (trusted) and the ticket's checkpoint names
    # optimizer_class 'nhtmp_proj.train:Opt' (load_step resolves the optimizer after the loss)
    resolve("nhtmp_proj.losses:mse", what="loss function", trusted=True)
    with pytest.raises(InputError):
        resolve("nhtmp_proj.train:Opt", what="optimizer class", trusted=False)
    # THEN the project's train.py did not run: it is in the current directory, confirmed by nothing
    assert not marker.exists()


def test_relative_pythonpath_entry_does_not_admit_a_later_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_imports: None) -> None:
    # GIVEN Python started in proj/ with PYTHONPATH=. (sys.path holds proj/ itself, and '' for `python -c` or a
    # notebook); the user then chdir'ed into the unpacked ticket, which holds model.py
    proj, ticket = tmp_path / "proj", tmp_path / "ticket"
    proj.mkdir()
    ticket.mkdir()
    marker = tmp_path / "MODEL_RAN"
    (ticket / "nhtmp_model.py").write_text(f"open({str(marker)!r}, 'w').close()\nimport torch\n"
                                              "class Net(torch.nn.Linear):\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", ".")
    monkeypatch.setattr(sys, "path", ["", str(proj), *sys.path])
    monkeypatch.chdir(ticket)
    # WHEN the ticket's capture names model factory 'nhtmp_model:Net'
    with pytest.raises(InputError):
        resolve("nhtmp_model:Net", what="model factory", trusted=False)
    # THEN it was not imported: the ticket directory is the current directory, not on PYTHONPATH (proj/ is)
    assert not marker.exists()


def test_untrusted_package_directory_in_cwd_is_refused_but_pythonpath_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_imports: None) -> None:
    # GIVEN a package directory in the current directory, and the same-named code installed on PYTHONPATH
    cwd, lib = tmp_path / "cwd", tmp_path / "lib"
    marker = tmp_path / "CWD_RAN"
    for root, body in ((cwd, f"open({str(marker)!r}, 'w').close()\n"), (lib, "")):
        (root / "nhtmp_pkg").mkdir(parents=True)
        (root / "nhtmp_pkg" / "__init__.py").write_text("")
        (root / "nhtmp_pkg" / "nets.py").write_text(body + "import torch\nclass Net(torch.nn.Linear):\n    pass\n")
    (cwd / "nhtmp_other").mkdir()  # only in the current directory
    (cwd / "nhtmp_other" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", ["", str(lib), *sys.path])
    monkeypatch.setenv("PYTHONPATH", str(lib))
    # WHEN both packages are trusted by name (--trust-names)
    trust = ("nhtmp_pkg", "nhtmp_other")
    # THEN the package on PYTHONPATH is used, the current directory's never runs
    net = resolve("nhtmp_pkg.nets:Net", what="model factory", trusted=False, trust=trust)
    assert Path(sys.modules[net.__module__].__file__).parent.parent == lib  # type: ignore[arg-type]
    with pytest.raises(InputError, match="current directory"):
        resolve("nhtmp_other.x:Net", what="model factory", trusted=False, trust=trust)
    assert not marker.exists()
