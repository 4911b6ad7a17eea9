"""Small hostile files that would crash, blow up or hang nanhunt: refused in one line (exit 2) before any parser
or torch reads them, within bounded memory. The files come from ``hostile.py``; the CLI runs as a child process
where a crash or the peak memory is what is checked."""

from __future__ import annotations

import io
import pickle
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from nanhunt.cli import main
from tests._support.peak import run_nanhunt

from . import hostile

ROOT = Path(__file__).resolve().parents[2]
CLEAN = [str(ROOT / "fixtures" / "clean" / "checkpoint.pt"), str(ROOT / "fixtures" / "clean" / "batch.pt")]
TRUSTED = ["--model", "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss"]
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def _one_line(code: int, err: str) -> str:
    """Exit 2 and exactly one stderr line, ``nanhunt: error: ...`` (no traceback)."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanhunt: error:"), err
    return lines[0]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    return _one_line(code, capsys.readouterr().err)


def _child(argv: list[str], tmp_path: Path) -> tuple[str, int]:
    """``python -m nanhunt ARGV`` in a child process: its one error line and its peak resident memory in bytes
    (Linux). A crash (a negative exit code, 139 from a shell) fails the exit-code check."""
    code, err, peak = run_nanhunt(argv, tmp_path)
    assert "Traceback" not in err, err
    return _one_line(code, err), peak


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name)


def _legacy(pkl: bytes) -> bytes:
    """A file in torch's legacy (non-zip) format whose object pickle is ``pkl`` and which holds no storage."""
    info = {"protocol_version": torch.serialization.PROTOCOL_VERSION, "little_endian": sys.byteorder == "little",
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
    head = b"".join(pickle.dumps(x, protocol=2) for x in (torch.serialization.MAGIC_NUMBER,
                                                           torch.serialization.PROTOCOL_VERSION, info))
    return head + pkl + pickle.dumps([], protocol=2)


# ------------------------------------------------------------------- depth
def test_torch_bytes_in_memory_get_the_checks_of_a_file() -> None:
    from nanhunt._util._errors import InputError
    from nanhunt._util._safeload import check_bytes

    # GIVEN torch files held in memory, as a DCP checkpoint holds its entries: hostile, then a tensor torch.save wrote
    hostile_files = {"nests containers more than 64 levels deep": hostile.deep_pickle(1_000_000),
                     "nests containers more than 64 levels deep;": _legacy(b"\x80\x02})" + b"\x85" * 1000 + b"Ns."),
                     "'archive/data/0' and 'archive/data/1' overlap": hostile.overlapping_zip(2, mib=1)}
    for why, data in hostile_files.items():
        # WHEN checked THEN refused as the same file on disk would be
        with pytest.raises(InputError, match=f"^the data of 'w' .*{why}"):
            check_bytes(data, name="the data of 'w'")
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    check_bytes(buf.getvalue(), name="the data of 'w'")


@pytest.mark.subprocess
def test_key_nested_a_million_deep_is_one_line_not_a_crash(tmp_path: Path) -> None:
    # GIVEN a 1.4 kB checkpoint whose dict key is a tuple nested a million deep (hashing it overflowed the C stack)
    path = _write(tmp_path, "deep.pt", hostile.deep_pickle(1_000_000))
    # WHEN it is inspected, in a child process
    line, _ = _child(["inspect", path], tmp_path)
    # THEN exit 2 and one line naming the depth: refused before torch unpickled it
    assert f"checkpoint {path!r} nests containers more than 64 levels deep" in line, line


@pytest.mark.subprocess
def test_decoy_pickle_listed_first_does_not_hide_the_one_torch_reads(tmp_path: Path) -> None:
    # GIVEN a checkpoint holding a harmless archive/decoy/data.pkl listed before the archive/data.pkl torch reads
    # (in the directory of the first member), a key nested a million deep
    path = _write(tmp_path, "deep.pt", hostile.decoy_pickle(1_000_000))
    # WHEN it is inspected, in a child process THEN the pickle torch reads is the one refused
    line, _ = _child(["inspect", path], tmp_path)
    assert f"checkpoint {path!r} nests containers more than 64 levels deep" in line, line


def test_two_members_of_one_name_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a checkpoint whose directory lists archive/data.pkl twice: a harmless one, then a deep one
    path = _write(tmp_path, "deep.pt", hostile.decoy_pickle(1000, same_name=True))
    # WHEN it is inspected THEN one line: which of the two a reader takes is the reader's choice
    line = _run(["inspect", path], capsys)
    assert f"checkpoint {path!r} is not a valid zip archive: it lists two members named 'archive/data.pkl'" \
        in line, line


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("how", ["tuple1", "marks", "legacy"])
def test_deep_pickle_is_refused_before_unpickling(depth: int, how: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a batch whose pickle is a dict keyed by a tuple nested `depth` deep: one TUPLE1 a level, or `depth`
    # MARKs closed by as many TUPLEs, or the first form in torch's legacy format
    if how == "marks":
        data = hostile.torch_zip(b"\x80\x02}" + b"(" * depth + b")" + b"t" * depth + b"Ns.")
    elif how == "legacy":
        data = _legacy(b"\x80\x02})" + b"\x85" * depth + b"Ns.")
    else:
        data = hostile.deep_pickle(depth)
    path = _write(tmp_path, "batch.pt", data)
    # WHEN it is replayed (a RecursionError's traceback and exit 1 before)
    line = _run(["replay", CLEAN[0], path, *TRUSTED], capsys)
    # THEN one line
    assert f"batch {path!r} nests containers more than 64 levels deep" in line, line


def test_many_marks_unclosed_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a pickle opening 100 000 MARKs and closing none (torch's unpickler keeps a stack for each)
    path = _write(tmp_path, "batch.pt", hostile.torch_zip(b"\x80\x02" + b"(" * 100_000 + b"N."))
    # WHEN it is replayed THEN one line, about depth
    line = _run(["replay", CLEAN[0], path, *TRUSTED], capsys)
    assert "more than 64 levels deep" in line, line


# ------------------------------------------------------------------ memory
@pytest.mark.subprocess
def test_eight_million_empty_lists_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    # GIVEN an 8 kB checkpoint whose deflated data.pkl makes 8 million empty lists (3.3 GB once loaded)
    path = _write(tmp_path, "lists.pt", hostile.many_lists(8_000_000))
    # WHEN it is inspected, in a child process
    line, peak = _child(["inspect", path], tmp_path)
    # THEN one line names the opcode count, and the process stayed under 1 GiB
    assert f"checkpoint {path!r} is a pickle of more than 2,000,000 opcodes" in line, line
    assert peak < GIB, peak


@pytest.mark.subprocess
def test_deflated_gib_of_zeros_in_a_batch_is_refused_before_reading(tmp_path: Path) -> None:
    # GIVEN a 4.5 MB batch whose inputs' storage is a GiB of deflated zeros (deflated harder, 1 MB: the same)
    path = _write(tmp_path, "batch.pt", hostile.zero_storage_batch(1024))
    # WHEN it is replayed, in a child process
    line, peak = _child(["replay", CLEAN[0], path, *TRUSTED], tmp_path)
    # THEN one line names the member and how far it inflates; nothing near a GiB was allocated
    assert f"batch {path!r} is not as torch.save writes it: its member 'archive/data/0' inflates" in line, line
    assert "1,024.0 MiB" in line, line
    assert peak < GIB, peak


def test_repacked_capture_with_deflated_members_still_replays(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN the clean capture re-packed with every member deflated (zip -r: torch reads it too)
    files = []
    for src in CLEAN:
        dst = tmp_path / Path(src).name
        with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as out:
            for info in z.infolist():
                out.writestr(info.filename, z.read(info))
        files.append(str(dst))
    # WHEN it is replayed THEN it replays as the original does (clean: exit 0)
    assert main(["replay", *files, *TRUSTED, "--no-bisect"]) == 0, capsys.readouterr().err


# -------------------------------------------------------------------- hang
def test_directory_entries_sharing_one_member_are_refused_before_any_crc(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a checkpoint whose directory lists 64 more members that all point at its one 64 MiB deflated storage
    path = _write(tmp_path, "ckpt.pt", hostile.overlapping_zip(64, mib=64))
    # WHEN it is inspected (each CRC inflated the storage again: a GiB storage and 10 000 entries hang)
    line = _run(["inspect", path], capsys)
    # THEN one line says two members share bytes
    assert f"checkpoint {path!r} is not a valid zip archive: its members 'archive/data/0' and 'archive/data/1' " \
           "overlap" in line, line


# -------------------------------------------------------------------- JSON
@pytest.mark.subprocess
def test_report_of_a_40_mib_json_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    # GIVEN a 40 MiB JSON array of empty arrays (a 99 MB one took 2.45 GB to parse)
    path = _write(tmp_path, "big.json", hostile.big_json(40))
    # WHEN it is rendered again, in a child process
    line, peak = _child(["report", path], tmp_path)
    # THEN one line names its size and the cap, and nothing near a GiB was used
    assert f"{path!r} holds 40.0 MiB, more than nanhunt reads of a nanhunt JSON report (16 MiB); write it " \
           "again with nanhunt replay --report x.json" in line, line
    assert peak < GIB, peak


@pytest.mark.parametrize("depth", [100, 100_000])
def test_rule_nested_deep_is_one_line(depth: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN an acceptance rule whose one clause nests lists 100 or 100 000 deep (the second was a RecursionError)
    rule = _write(tmp_path, "rule.json", b'{"task": "none", "rtol": ' + b"[" * depth + b"]" * depth + b"}")
    # WHEN compare reads it THEN one line, before any file is loaded
    line = _run(["compare", *CLEAN, *TRUSTED, "--rule", rule], capsys)
    assert f"the rule {rule!r} is not an acceptance rule (JSON): it nests more than 64 levels deep" in line, line


def test_pickle_over_16_mib_is_refused_unread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a checkpoint whose data.pkl is one 17 MiB string (torch.save writes some 100 bytes a tensor)
    text = b"x" * (17 << 20)
    path = _write(tmp_path, "ckpt.pt", hostile.torch_zip(b"\x80\x02X" + len(text).to_bytes(4, "little") + text + b"."))
    # WHEN it is inspected THEN one line names the pickle and its size
    line = _run(["inspect", path], capsys)
    assert f"checkpoint {path!r} holds a pickle ('archive/data.pkl') of 17.0 MiB" in line, line
