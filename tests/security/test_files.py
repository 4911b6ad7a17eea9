"""Damaged, malformed and hostile input files: one error line and exit 2, or a correct replay.

Loading lives in ``nanhunt/_util/_safeload.py``: a zip archive's CRC-32s are checked before torch reads it,
a file that is no torch file is said to be one, ``--trust-pickle`` is suggested only for a valid pickle
naming globals the safe loader refuses, and what loads is checked for depth and for tensors that are
not dense data (a stride-0 view of 2**40 elements).
"""

from __future__ import annotations

import io
import os
import pickle
import random
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt.cli import main
from nanhunt.records import Report

ROOT = Path(__file__).resolve().parents[2]
CLEAN = [str(ROOT / "fixtures" / "clean" / "checkpoint.pt"), str(ROOT / "fixtures" / "clean" / "batch.pt")]
# names given on the command line are trusted: these tests do not depend on how names read from a file resolve
TRUSTED = ["--model", "fixtures.models:MLP", "--loss", "torch.nn.functional:mse_loss"]


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def _one_line(code: int, err: str) -> str:
    """Exit 2 and exactly one stderr line, ``nanhunt: error: ...`` (no traceback)."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanhunt: error:"), err
    return lines[0]


def _capture(directory: Path) -> list[str]:
    """A capture of MLP whose fc2 overflows float16 (replay: exit 1, found in the forward)."""
    from fixtures.models import MLP

    torch.manual_seed(0)
    m = MLP()
    with torch.no_grad():
        m.fc2.weight.mul_(3e4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    files = [str(directory / "checkpoint.pt"), str(directory / "batch.pt")]
    nanhunt.save_capture(*files, model=m, batch=(torch.randn(4, 16) * 10, torch.randn(4, 4)), loss_fn=F.mse_loss,
                         optimizer=opt, scaler=torch.amp.GradScaler("cpu"), model_factory="fixtures.models:MLP")
    return files


class _Mkdir:
    """Unpickling it creates a directory: proof that code from the file ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.path),))


# ---------------------------------------------------------------- malformed
def _empty_zip() -> bytes:
    buf = io.BytesIO()
    zipfile.ZipFile(buf, "w").close()
    return buf.getvalue()


MALFORMED: dict[str, tuple[bytes, str]] = {
    "text": (b"step,loss\n1,0.25\n2,nan\n", "not a torch file: it holds text"),
    "dot": (b".", "not a torch file"),
    "nul": (b"\x00", "not a torch file: it holds binary data"),
    "one-byte": (b"\x80", "corrupt or truncated pickle"),
    "random": (random.Random(19).randbytes(4096).replace(b"PK", b"pk").lstrip(b"\x80") or b"x", "not a torch file"),
    "empty-zip": (_empty_zip(), "empty zip archive"),
    "zip-without-pickle": (b"", "no data.pkl"),  # filled in below
    "truncated-zip": (b"", "damaged zip archive"),
}


def _malformed(kind: str, tmp_path: Path) -> bytes:
    if kind == "zip-without-pickle":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("archive/weights.txt", "1 2 3")
        return buf.getvalue()
    if kind == "truncated-zip":
        return Path(_capture(tmp_path)[0]).read_bytes()[:1000]
    return MALFORMED[kind][0]


@pytest.mark.parametrize("role", ["checkpoint", "batch"])
@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_file_is_one_line_that_says_what_it_is(kind: str, role: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a file that is no torch file (text, a lone '.', a NUL byte, garbage, an empty or broken zip)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(_malformed(kind, tmp_path))
    files = [str(bad), CLEAN[1]] if role == "checkpoint" else [CLEAN[0], str(bad)]
    # WHEN it is replayed as the checkpoint or the batch
    code, err = _run(["replay", *files, *TRUSTED], capsys)
    # THEN one line says what the file is, and never suggests disabling the safe loader
    line = _one_line(code, err)
    assert f"{role} {str(bad)!r}" in line and MALFORMED[kind][1] in line, line
    assert "--trust-pickle" not in line and "pickled" not in line, line


def _deep(depth: int) -> Any:
    x: Any = torch.ones(2, 16)
    for _ in range(depth):
        x = [x]
    return x


def _cyclic() -> Any:
    loop: list[Any] = [torch.ones(2, 16)]
    loop.append(loop)
    return loop


@pytest.mark.parametrize("shape", ["nested-700", "nested-5000", "cycle"])
def test_deeply_nested_batch_is_one_line(shape: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a batch nested 700 or 5000 lists deep, or a list that holds itself (pickle's memo allows it)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save recurses once per level
    try:
        inputs = _cyclic() if shape == "cycle" else _deep(int(shape.split("-")[1]))
        torch.save((inputs, torch.zeros(2, 4)), tmp_path / "batch.pt")
    finally:
        sys.setrecursionlimit(limit)
    # WHEN it is replayed
    code, err = _run(["replay", CLEAN[0], str(tmp_path / "batch.pt"), *TRUSTED], capsys)
    # THEN one line (not a RecursionError's 3000)
    assert "levels deep" in _one_line(code, err)


def test_stride0_view_of_2_40_elements_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a checkpoint whose 4-byte tensor is viewed as 2**40 elements (8 TB once inspect reads it in float64)
    torch.save({"w": torch.zeros(1).expand(2**40)}, tmp_path / "ckpt.pt")
    # WHEN it is inspected
    code, err = _run(["inspect", str(tmp_path / "ckpt.pt")], capsys)
    # THEN one line names the tensor; nothing was allocated
    line = _one_line(code, err)
    assert "['w']" in line and "strides (0,)" in line


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_tensor_without_dense_data_is_refused(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a checkpoint holding a meta tensor (no data) or a sparse one of 2**40 elements
    t = torch.empty(2**40, device="meta") if kind == "meta" else torch.sparse_coo_tensor(
        torch.tensor([[0, 2**20]]), torch.tensor([1.0, 2.0]), (2**40,))
    torch.save({"w": t}, tmp_path / "ckpt.pt")
    # WHEN it is inspected THEN one line names it
    code, err = _run(["inspect", str(tmp_path / "ckpt.pt")], capsys)
    assert "['w']" in _one_line(code, err)


@pytest.mark.subprocess
def test_malformed_files_as_a_subprocess(tmp_path: Path) -> None:
    # GIVEN a '.' checkpoint and a batch nested 700 deep
    (tmp_path / "dot.pt").write_bytes(b".")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        torch.save((_deep(700), None), tmp_path / "deep.pt")
    finally:
        sys.setrecursionlimit(limit)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv in (["inspect", str(tmp_path / "dot.pt")], ["replay", CLEAN[0], str(tmp_path / "deep.pt"), *TRUSTED]):
        # WHEN run as python -m nanhunt
        p = subprocess.run([sys.executable, "-m", "nanhunt", *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        # THEN exit 2 and one stderr line
        _one_line(p.returncode, p.stderr)


# ----------------------------------------------------------------- pickles
@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_hostile_pickle_names_its_globals(zip_format: bool, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a torch file whose unpickling would call os.mkdir
    marker = tmp_path / "RAN"
    torch.save({"model": _Mkdir(marker)}, tmp_path / "ckpt.pt", _use_new_zipfile_serialization=zip_format)
    # WHEN it is inspected without --trust-pickle
    code, err = _run(["inspect", str(tmp_path / "ckpt.pt")], capsys)
    # THEN refused in one line that names the global and the flag; nothing ran
    line = _one_line(code, err)
    assert f"({os.mkdir.__module__}.mkdir)" in line and "--trust-pickle" in line, line
    assert not marker.exists()


def test_plain_pickle_never_runs_even_with_trust_pickle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a pickle.dump file (no torch file: torch would run it whole, then fail on the magic number)
    marker = tmp_path / "RAN"
    with open(tmp_path / "ckpt.pt", "wb") as f:
        pickle.dump({"model": _Mkdir(marker)}, f, protocol=2)
    # WHEN it is replayed with --trust-pickle
    code, err = _run(["replay", str(tmp_path / "ckpt.pt"), CLEAN[1], *TRUSTED, "--trust-pickle"], capsys)
    # THEN one error line (beside the flag's warning) says what it is, and nothing ran
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and "torch.save did not write" in lines[0], err
    assert not marker.exists()


def test_inspect_with_trust_pickle_warns(capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a clean checkpoint WHEN inspected with --trust-pickle
    code, err = _run(["inspect", CLEAN[0], "--trust-pickle"], capsys)
    # THEN it warns as replay does
    assert code == 0
    assert err.startswith("warning: --trust-pickle"), err


# -------------------------------------------------------------- corruption
def _flip_in_tensor(path: str, t: torch.Tensor) -> None:
    data = bytearray(Path(path).read_bytes())
    at = data.find(t.detach().numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0x01  # the lowest mantissa bits of one float32: replays as a slightly different number
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("role", ["checkpoint", "batch"])
def test_flipped_bit_in_tensor_data_is_reported_corrupt(role: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture with one bit flipped in fc1's weights or in the batch's inputs
    files = _capture(tmp_path)
    ck = torch.load(files[0], weights_only=True)
    bt = torch.load(files[1], weights_only=True)
    _flip_in_tensor(*((files[0], ck["model"]["fc1.weight"]) if role == "checkpoint" else (files[1], bt["inputs"])))
    # WHEN it is replayed
    code, err = _run(["replay", *files, *TRUSTED, "--no-bisect"], capsys)
    # THEN one line calls the file corrupt (torch alone would replay different numbers)
    line = _one_line(code, err)
    assert "corrupt" in line and "CRC-32" in line and f"{role} {files[role == 'batch']!r}" in line, line


# ------------------------------------------------------------ model dtypes
def test_non_float_weights_are_refused_float_widths_are_not(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from fixtures.models import MLP

    torch.manual_seed(0)
    sd = MLP().state_dict()
    torch.save((torch.randn(4, 16), torch.randn(4, 4)), tmp_path / "batch.pt")
    for dtype in (torch.int64, torch.bool, torch.complex64, torch.float64):
        # GIVEN a state_dict whose fc1.weight is int64, bool, complex64 or float64 (the model's is float32)
        torch.save({**sd, "fc1.weight": sd["fc1.weight"].to(dtype)}, tmp_path / "ckpt.pt")
        # WHEN it is replayed
        code, err = _run(["replay", str(tmp_path / "ckpt.pt"), str(tmp_path / "batch.pt"), *TRUSTED,
                          "--dtype", "float32", "--no-bisect"], capsys)
        # THEN a non-float dtype is refused in one line naming the key; another float width loads
        if dtype.is_floating_point:
            assert code == 0, err
        else:
            line = _one_line(code, err)
            assert "fc1.weight" in line and str(dtype).replace("torch.", "") in line, line


@pytest.mark.parametrize("indices, bad", [([-1, 0, 1, 2], "-1"), ([0, 0, 1, 2], "0"), ([0, 1, 2, 99], "99"),
                                          ([0, 1, 2, "3"], "'3'")])
def test_bad_optimizer_param_indices_are_one_line(indices: list[Any], bad: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from fixtures.models import MLP

    # GIVEN a capture whose optimizer state names parameter -1, 0 twice, 99 (of 4) or "3"
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    state = opt.state_dict()
    state["param_groups"][0]["params"] = indices
    files = [str(tmp_path / "checkpoint.pt"), str(tmp_path / "batch.pt")]
    nanhunt.save_capture(*files, model=m, batch=(torch.randn(4, 16), torch.randn(4, 4)), loss_fn=F.mse_loss,
                         optimizer=opt, optimizer_state=state, model_factory="fixtures.models:MLP")
    # WHEN it is replayed
    code, err = _run(["replay", *files, *TRUSTED, "--no-bisect"], capsys)
    # THEN one line names the group and the index
    line = _one_line(code, err)
    assert f"param_groups[0] names parameter {bad}," in line, line


# --------------------------------------------------------------------- fuzz
def _first(report: Path) -> tuple[object, ...] | None:
    first = Report.from_json(report.read_text()).first
    return None if first is None else (first.phase.value, first.module, first.op, first.kind)


def _mutations(data: bytes, rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for _ in range(n):
        b = bytearray(data)
        how = rng.choice(["truncate", "flip", "flip", "garbage"])
        if how == "truncate":
            b = b[:rng.randrange(1, len(b))]
        elif how == "flip":
            for _ in range(rng.choice([1, 1, 2, 8])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        else:  # a span overwritten in place, or replaced by one of another length
            at, n = rng.randrange(len(b)), rng.randrange(1, 64)
            b[at:at + n] = rng.randbytes(n if rng.random() < 0.7 else rng.randrange(1, 64))
        out.append((how, bytes(b)))
    return out


def test_fuzzed_capture_is_one_line_or_the_same_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture and its replay (exit 1, fc2 overflows)
    files = _capture(tmp_path)
    intact = [Path(f).read_bytes() for f in files]
    report = tmp_path / "r.json"
    argv = ["replay", *files, *TRUSTED, "--no-bisect", "--report", str(report)]
    expected = (main(argv), _first(report))
    assert expected[0] == 1 and expected[1] is not None
    capsys.readouterr()
    rng = random.Random(1919)
    for i, (path, data) in enumerate(zip(files, intact)):
        for how, bad in _mutations(data, rng, 60):
            # WHEN one file is truncated, has bits flipped or a span overwritten (the other intact)
            Path(path).write_bytes(bad)
            report.unlink(missing_ok=True)
            code, err = _run(argv, capsys)
            # THEN exit 2 in one line, or the very replay of the intact files
            case = f"{Path(path).name} {how}"
            if code == 2:
                assert len(err.strip().splitlines()) == 1 and err.startswith("nanhunt: error:"), (case, err)
            else:
                assert (code, _first(report)) == expected, (case, err)
        Path(path).write_bytes(intact[i])


def _rezip(path: str, pkl: bytes) -> None:
    """Write ``path`` again with ``pkl`` as its data.pkl and valid CRCs: a crafted, not a damaged, file."""
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, pkl if name.endswith("/data.pkl") else data)


def test_fuzzed_pickle_with_valid_crcs_never_gives_a_traceback(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a capture whose files are re-zipped with a mutated data.pkl and correct CRCs
    files = _capture(tmp_path)
    pickles = []
    for f in files:
        with zipfile.ZipFile(f) as z:
            pickles.append(z.read(next(n for n in z.namelist() if n.endswith("/data.pkl"))))
    intact = [Path(f).read_bytes() for f in files]
    rng = random.Random(191919)
    argv = ["replay", *files, *TRUSTED, "--no-bisect"]
    for i, path in enumerate(files):
        for how, bad in _mutations(pickles[i], rng, 50):
            _rezip(path, bad)
            # WHEN it is replayed
            code, err = _run(argv, capsys)
            # THEN exit 2 in one line, or a replay (flags and hyperparameters may differ) with no error
            case = f"{Path(path).name} {how}"
            if code == 2:
                assert len(err.strip().splitlines()) == 1 and err.startswith("nanhunt: error:"), (case, err)
            else:
                assert code in (0, 1, 3) and "nanhunt: error" not in err, (case, err)
        Path(path).write_bytes(intact[i])
