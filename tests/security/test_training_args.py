"""A Trainer checkpoint's training_args.bin is read without running it: every global it names becomes an inert
stand-in, so a file that names os.system or a constructor runs nothing, and only plain values come back."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from nanhunt._util._errors import InputError
from nanhunt.capture._training_args import read_training_args


def _args(tmp_path: Path, **kw: Any) -> str:
    from transformers import TrainingArguments

    path = tmp_path / "training_args.bin"
    torch.save(TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **kw), path)
    return str(path)


def test_the_precision_and_the_optimisation_are_read_back(tmp_path: Path) -> None:
    got = read_training_args(_args(tmp_path, bf16=True, learning_rate=1e4, warmup_steps=7), "checkpoint-3")
    assert got is not None
    assert (got["bf16"], got["fp16"], got["use_cpu"]) == (True, False, True)
    assert (got["learning_rate"], got["warmup_steps"], got["max_grad_norm"]) == (1e4, 7, 1.0)
    assert got["lr_scheduler_type"] == "linear"  # an enum member: its value


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_file_naming_code_runs_none_of_it(tmp_path: Path) -> None:
    # GIVEN a training_args.bin written by torch.save whose object is os.system("touch marker")
    marker = tmp_path / "ran"
    path = tmp_path / "training_args.bin"
    torch.save(_Payload(str(marker)), path)
    # WHEN nanhunt reads it
    got = read_training_args(str(path), "checkpoint-3")
    # THEN nothing ran, and the file holds no TrainingArguments
    assert got is None
    assert not marker.exists()


class _Forged:
    """Pickled under transformers' name (the test puts it there while pickling)."""


def test_a_class_named_like_training_arguments_gives_only_plain_values(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # a forged TrainingArguments whose fields are objects (and one NaN, one huge string): only plain values back
    import transformers.training_args

    _Forged.__module__, _Forged.__qualname__ = "transformers.training_args", "TrainingArguments"
    monkeypatch.setattr(transformers.training_args, "TrainingArguments", _Forged)
    a = _Forged()
    a.__dict__.update(fp16=_Payload(str(tmp_path / "ran")), bf16=True, learning_rate=float("nan"),
                      lr_scheduler_type="x" * 10_000 + "\x1b[2J")
    path = tmp_path / "training_args.bin"
    data = pickle.dumps(a, protocol=2)
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/version", "3\n")
    path.write_bytes(buf.getvalue())
    got = read_training_args(str(path), "checkpoint-3")
    assert got is not None and got["bf16"] is True
    assert "fp16" not in got and "learning_rate" not in got  # an object and a NaN are no plain values
    assert len(got["lr_scheduler_type"]) == 64 and "\x1b" not in got["lr_scheduler_type"]
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("content", [b"", b"not a torch file", b"PK\x03\x04" + b"\0" * 40])
def test_a_damaged_file_is_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "training_args.bin"
    path.write_bytes(content)
    with pytest.raises(InputError) as e:
        read_training_args(str(path), "checkpoint-3")
    assert "\n" not in str(e.value) and "training_args.bin" in str(e.value)
