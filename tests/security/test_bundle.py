"""Files nanhunt writes (--bundle, --report, report -o): never through a link, never silently over an
earlier bundle, never over or beside files nanhunt did not write (a bundle directory is new, empty or an
earlier bundle, which holds nanhunt's marker), and a bundle path that cannot be written fails in one line
before the replay."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nanhunt._util._errors import InputError
from nanhunt.cli import main

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ("report.md", "report.json", "report.html", "report.png", "repro.py", "repro_inputs.pt")
MARKER = ".nanhunt-bundle"  # in every bundle: what makes a directory one nanhunt may replace
# A plain state_dict of fixtures.models:MLP: confirmed on the command line, so no name is read from the file.
ARGS = ["--model", "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss", "--no-bisect"]
VICTIM = b"the user's own file\n"


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # fixtures.models imports from the repository root


@pytest.fixture(scope="module")
def overflow(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A step whose fc1 matmul overflows float16 in backward: a report, its picture and a verified repro."""
    from fixtures.models import MLP

    d = tmp_path_factory.mktemp("overflow")
    torch.manual_seed(0)
    torch.save(MLP().state_dict(), d / "checkpoint.pt")
    torch.save((torch.full((4, 16), 3e4), torch.randn(4, 4)), d / "batch.pt")
    return [str(d / "checkpoint.pt"), str(d / "batch.pt")]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from fixtures.models import MLP

    d = tmp_path_factory.mktemp("clean")
    torch.manual_seed(0)
    torch.save(MLP().state_dict(), d / "checkpoint.pt")
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), d / "batch.pt")
    return [str(d / "checkpoint.pt"), str(d / "batch.pt")]


@pytest.fixture
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the step is replayed: the error must come first."""
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the step was replayed before the output path was checked")

    # the CLI imports the pipeline (nanhunt.hunt.pipeline.hunt) when it runs: patch the module attribute
    monkeypatch.setattr(importlib.import_module("nanhunt.hunt.pipeline"), "hunt", boom)


def _one_error_line(code: int, err: str, *words: str) -> str:
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("nanhunt: error:"), err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_bytes(VICTIM)
    return v


@pytest.fixture(scope="module")
def earlier(clean: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle nanhunt wrote (a clean step's: the reports and the marker)."""
    d = tmp_path_factory.mktemp("earlier") / "bundle"
    assert main(["replay", *clean, *ARGS, "--dtype", "float32", "--bundle", str(d)]) == 0
    return d


def _old_bundle(earlier: Path, where: Path) -> Path:
    """A copy of an earlier bundle at ``where`` in which every file of a bundle (a repro too) holds b"old\n"."""
    shutil.copytree(earlier, where)
    for name in BUNDLE:
        (where / name).write_bytes(b"old\n")
    return where


def _contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


# ------------------------------------------------------------------ links


@pytest.mark.parametrize("name", BUNDLE)
def test_a_link_at_a_bundle_name_is_refused_and_its_target_untouched(
        name: str, overflow: list[str], tmp_path: Path, no_replay: None, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a bundle directory where someone planted <name> -> ../victim.txt
    victim = _victim(tmp_path)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / name).symlink_to(Path("..") / "victim.txt")
    # WHEN a replay writes its bundle there
    code = main(["replay", *overflow, *ARGS, "--bundle", str(bundle)])
    # THEN one error line names the link, before the replay; the target and the link are as they were
    _one_error_line(code, capsys.readouterr().err, name, "symbolic link")
    assert victim.read_bytes() == VICTIM
    assert os.readlink(bundle / name) == os.path.join("..", "victim.txt")


@pytest.mark.parametrize("name", ["r.html", "r.png"])
def test_a_link_at_a_report_path_is_refused(name: str, overflow: list[str], tmp_path: Path, no_replay: None,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN --report r.html (which also writes r.png beside it) where <name> is a link to the user's file
    victim = _victim(tmp_path)
    (tmp_path / name).symlink_to(victim)
    # WHEN replayed
    code = main(["replay", *overflow, *ARGS, "--report", str(tmp_path / "r.html")])
    # THEN refused in one line before the replay; the target is untouched
    _one_error_line(code, capsys.readouterr().err, name, "symbolic link")
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("out", ["out.md", "out.html", "out.png"])
def test_report_output_through_a_link_is_refused(out: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a saved JSON report and an output path (or the picture beside it) that is a link to the user's file
    victim = _victim(tmp_path)
    (tmp_path / out).symlink_to(victim)
    target = str(tmp_path / (out if out != "out.png" else "out.html"))
    # WHEN it is rendered with -o
    code = main(["report", str(ROOT / "tests" / "golden" / "report.json"), "-o", target])
    # THEN one error line names the link and the target is untouched
    _one_error_line(code, capsys.readouterr().err, out, "symbolic link")
    assert victim.read_bytes() == VICTIM


def test_a_link_planted_while_writing_is_never_written_through(tmp_path: Path) -> None:
    from nanhunt._util._files import new_file

    # GIVEN a write in progress to report.md
    victim = _victim(tmp_path)
    path = tmp_path / "report.md"
    # WHEN a link to the user's file appears at the name before the new file is renamed onto it
    with pytest.raises(InputError, match="symbolic link"):
        with new_file(str(path)) as f:
            path.symlink_to(victim)
            f.write(b"report")
    # THEN the target is untouched and no temporary file is left behind
    assert victim.read_bytes() == VICTIM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "victim.txt"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_symlinked_bundle_directory_is_followed(overflow: list[str], tmp_path: Path) -> None:
    # GIVEN a bundle directory that is a link the user made to a real directory
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    # WHEN a replay writes its bundle through the link
    code = main(["replay", *overflow, *ARGS, "--bundle", str(tmp_path / "link")])
    # THEN the bundle is in the real directory, and the link is still a link to it
    assert code == 1
    assert sorted(p.name for p in real.iterdir()) == sorted((*BUNDLE, MARKER))
    assert os.readlink(tmp_path / "link") == str(real)


@pytest.mark.subprocess
def test_every_bundle_holds_nanhunts_marker_naming_its_format(overflow: list[str], tmp_path: Path) -> None:
    # GIVEN a new bundle directory
    bundle = tmp_path / "bundle"
    # WHEN a replay writes its bundle there
    assert main(["replay", *overflow, *ARGS, "--bundle", str(bundle)]) == 1
    # THEN it holds the bundle's files and the marker, a one-line text naming the format; nothing beside it
    assert sorted(p.name for p in bundle.iterdir()) == sorted((*BUNDLE, MARKER))
    assert (bundle / MARKER).read_text(encoding="utf-8") == "nanhunt bundle, format 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


@pytest.mark.subprocess
def test_an_empty_directory_takes_the_bundle_and_keeps_its_permissions(overflow: list[str], tmp_path: Path) -> None:
    # GIVEN an empty directory the user made, readable by the group only
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o750)
    bundle.chmod(0o750)
    # WHEN a replay writes its bundle there
    assert main(["replay", *overflow, *ARGS, "--bundle", str(bundle)]) == 1
    # THEN the bundle is there, the directory's permissions as they were, and nothing else beside it
    assert sorted(p.name for p in bundle.iterdir()) == sorted((*BUNDLE, MARKER))
    assert bundle.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


@pytest.mark.parametrize("names", [("repro.py",), ("report.md", "notes.txt"), ("train.py",)],
                         ids=["repro.py", "report.md+notes.txt", "train.py"])
def test_a_directory_of_the_users_own_files_is_refused_before_the_replay(
        names: tuple[str, ...], overflow: list[str], tmp_path: Path, no_replay: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a directory holding the user's own files, one of them named as a bundle's file or none
    work = tmp_path / "work"
    work.mkdir()
    for name in names:
        (work / name).write_bytes(VICTIM)
    # WHEN a replay is asked to write its bundle there
    code = main(["replay", *overflow, *ARGS, "--bundle", str(work)])
    # THEN one line names the directory and the fix, before the replay, and every file is as it was
    line = _one_error_line(code, capsys.readouterr().err, repr(str(work)), "nanhunt did not write",
                           "give a new or empty directory, or remove them")
    assert "batch" not in line
    assert _contents(work) == {n: VICTIM for n in names}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_an_earlier_bundle_holding_a_file_of_the_users_is_refused(
        earlier: Path, overflow: list[str], tmp_path: Path, no_replay: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN an earlier bundle in which the user saved notes of their own
    bundle = _old_bundle(earlier, tmp_path / "bundle")
    (bundle / "notes.txt").write_bytes(VICTIM)
    before = _contents(bundle)
    # WHEN a replay writes its bundle there
    code = main(["replay", *overflow, *ARGS, "--bundle", str(bundle)])
    # THEN refused before the replay, naming the file that replacing the bundle would delete; nothing changed
    _one_error_line(code, capsys.readouterr().err, repr(str(bundle)), "notes.txt", "move them out")
    assert _contents(bundle) == before


def test_a_marker_that_is_a_link_makes_no_bundle(earlier: Path, overflow: list[str], tmp_path: Path,
                                                 no_replay: None, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a directory of the user's whose marker is a link to a real bundle's marker
    work = tmp_path / "work"
    work.mkdir()
    (work / "repro.py").write_bytes(VICTIM)
    (work / MARKER).symlink_to(earlier / MARKER)
    # WHEN a replay writes its bundle there
    code = main(["replay", *overflow, *ARGS, "--bundle", str(work)])
    # THEN refused: a link is not nanhunt's marker
    _one_error_line(code, capsys.readouterr().err, repr(str(work)), "nanhunt did not write")
    assert (work / "repro.py").read_bytes() == VICTIM


def test_a_report_inside_the_bundle_directory_is_refused(overflow: list[str], tmp_path: Path, no_replay: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN --report naming a file inside the (empty) bundle directory, which the bundle replaces whole
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    # WHEN replayed
    code = main(["replay", *overflow, *ARGS, "--report", str(bundle / "r.md"), "--bundle", str(bundle)])
    # THEN one line says so, before the replay
    _one_error_line(code, capsys.readouterr().err, "--report", "inside the bundle directory")
    assert list(bundle.iterdir()) == []


def test_the_current_directory_is_refused_as_a_bundle(overflow: list[str], tmp_path: Path, no_replay: None,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN an empty current directory
    monkeypatch.chdir(tmp_path)
    # WHEN it is given as the bundle directory (which nanhunt swaps whole for the new bundle)
    code = main(["replay", *overflow, *ARGS, "--bundle", "."])
    # THEN one line says why and what to give instead, before the replay
    _one_error_line(code, capsys.readouterr().err, "'.'", "current directory", "give another directory")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ an earlier bundle


@pytest.mark.subprocess
def test_an_earlier_bundle_is_replaced_and_said_so(earlier: Path, overflow: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN an earlier bundle, whose report.md is also a hard link to a file outside it
    bundle = _old_bundle(earlier, tmp_path / "bundle")
    victim = _victim(tmp_path)
    (bundle / "report.md").unlink()
    os.link(victim, bundle / "report.md")
    # WHEN a replay writes its bundle there
    code = main(["replay", *overflow, *ARGS, "--bundle", str(bundle)])
    err = capsys.readouterr().err
    # THEN every file is new, the file outside is untouched, and one stderr line says what was replaced
    assert code == 1, err
    assert all((bundle / n).read_bytes() != b"old\n" for n in BUNDLE)
    assert victim.read_bytes() == VICTIM
    said = [ln for ln in err.splitlines() if "earlier bundle" in ln]
    assert len(said) == 1 and all(n in said[0] for n in BUNDLE), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "victim.txt"]  # no directory left beside


def test_an_earlier_bundles_repro_is_removed_when_the_new_one_has_none(earlier: Path, clean: list[str],
                                                                         tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN an earlier bundle with a repro, and a step that is now clean (no op to reproduce)
    bundle = _old_bundle(earlier, tmp_path / "bundle")
    # WHEN a replay writes its bundle there
    code = main(["replay", *clean, *ARGS, "--dtype", "float32", "--bundle", str(bundle)])
    err = capsys.readouterr().err
    # THEN the old repro, which would reproduce the old bug beside the new report, is gone, and said so
    assert code == 0, err
    assert not (bundle / "repro.py").exists() and not (bundle / "repro_inputs.pt").exists()
    said = [ln for ln in err.splitlines() if "earlier bundle" in ln]
    assert len(said) == 1 and "repro.py" in said[0] and "removed" in said[0], err


# ------------------------------------------------------------------ paths that cannot be written


def test_a_bundle_path_that_is_a_file_fails_before_the_replay(overflow: list[str], tmp_path: Path, no_replay: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN --bundle naming an existing regular file
    victim = _victim(tmp_path)
    # WHEN replayed
    code = main(["replay", *overflow, *ARGS, "--bundle", str(victim)])
    # THEN one line naming it, not blamed on the batch, and the file is untouched
    line = _one_error_line(code, capsys.readouterr().err, "victim.txt", "not a directory")
    assert "batch" not in line
    assert victim.read_bytes() == VICTIM


def test_a_bundle_path_inside_a_file_fails_before_the_replay(overflow: list[str], tmp_path: Path, no_replay: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN --bundle naming a directory to make below a regular file
    victim = _victim(tmp_path)
    # WHEN replayed
    code = main(["replay", *overflow, *ARGS, "--bundle", str(victim / "sub")])
    # THEN one line naming the file in the way
    line = _one_error_line(code, capsys.readouterr().err, "victim.txt", "not a directory")
    assert "batch" not in line


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody can create files in, root included (immutable), else one without write permission."""
    d = tmp_path / "locked"
    d.mkdir()
    chattr = shutil.which("chattr")
    if chattr and subprocess.run([chattr, "+i", str(d)], capture_output=True).returncode == 0:
        try:
            yield d
        finally:
            subprocess.run([chattr, "-i", str(d)], capture_output=True)
        return
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("running as root without chattr: permission bits do not stop this process")
        yield d
    finally:
        d.chmod(0o700)


@pytest.mark.subprocess
def test_an_unwritable_bundle_directory_fails_before_the_replay(overflow: list[str], unwritable_dir: Path,
                                                                no_replay: None,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN --bundle naming a directory no file can be created in
    # WHEN replayed
    code = main(["replay", *overflow, *ARGS, "--bundle", str(unwritable_dir)])
    # THEN one line naming it, before the replay, not blamed on the batch
    line = _one_error_line(code, capsys.readouterr().err, "locked")
    assert "batch" not in line
