"""A Trainer checkpoint directory (``checkpoint-N/``) and its safetensors files are read bounded, and from the
directory alone.

A file inside it that is a symbolic link (or not a regular file at all: a FIFO) is refused in one line, never
followed: nothing outside the directory is read or shown. Every size a file gives is bounded before transformers or
torch builds anything from it: the label maps and per-layer lists a config makes transformers build, the layers a
config names (counted against the weights' tensors that hold data), the memory a torch file's views would take
once copied, a safetensors shape torch cannot hold. A damaged generator or GradScaler state is bad input (exit 2,
one line naming the file), not a nanhunt bug. What transformers logs while nanhunt builds a model from a config
(config keys and values, written raw) never reaches the terminal.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nanhunt._util._errors import InputError
from nanhunt._util._safeload import load_file
from nanhunt.cli import main

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
LINKED = ("is a symbolic link; nanhunt reads only the files a Trainer checkpoint directory holds, never one a link points "
          "to: copy the real files into it")
NOT_REGULAR = "is not a regular file; copy the checkpoint's real files"
CONFIG_FIX = "the config does not belong to them: pass --model package.module:factory"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Trainer checkpoint of the tiny GPT-2 (tests._support.hf) after one AdamW step, as the Trainer saves it
    (its decay and no-decay groups, the generator state), and the next step's batch beside it."""
    from tests._support.hf import tiny_gpt2

    out = tmp_path_factory.mktemp("saved")
    ck = out / "checkpoint-1"
    model = tiny_gpt2()
    model.save_pretrained(ck)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    opt = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}], lr=1e-3)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    torch.save(opt.state_dict(), ck / "optimizer.pt")
    torch.save({"cpu": torch.Generator().manual_seed(0).get_state()}, ck / "rng_state.pth")
    torch.save({"input_ids": ids, "labels": ids}, out / "batch.pt")
    return out


@pytest.fixture
def ck(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of the checkpoint, for a test to damage; its batch is ``batch.pt`` beside it."""
    shutil.copy(saved / "batch.pt", tmp_path / "batch.pt")
    return Path(shutil.copytree(saved / "checkpoint-1", tmp_path / "checkpoint-1"))


def _replay(ck: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``nanhunt replay CK batch.pt --no-bisect``: its exit code and its one error line (warnings aside)."""
    code = main(["replay", str(ck), str(ck.parent / "batch.pt"), "--no-bisect", "--dtype", "float32"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("warning:", "note:", " "))]
    assert "Traceback" not in err and len(lines) == 1, err
    return code, lines[0]


def _where(ck: Path) -> str:
    return f"nanhunt: error: Trainer checkpoint {str(ck)!r}"


def _config(ck: Path, **changes: Any) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, **changes}))


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


# ------------------------------------------------------------------ nothing outside the directory
def _linked_shard(ck: Path, outside: Path) -> str:
    """The weights as save_pretrained shards them, the second shard moved out and linked back."""
    from safetensors.torch import load_file as st_load, save_file

    weights = st_load(ck / "model.safetensors")
    (ck / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, ck / shard)
    (ck / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    return "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "optimizer.pt", "rng_state.pth", "shard"])
def test_a_file_of_the_checkpoint_that_links_outside_it_is_refused_unread(
        ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    # GIVEN a checkpoint whose file `name` was moved out of it and left as a link to where it now lies (so that
    # following the link would read a whole, valid checkpoint); the weights' link points at a secret instead
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if name == "shard":
        name = _linked_shard(ck, outside)
    shutil.move(ck / name, outside / name)
    if name == "model.safetensors":
        (outside / name).write_bytes(b"SECRET!!" + b"\0" * 64)
    (ck / name).symlink_to(outside / name)
    # WHEN it is replayed
    code, line = _replay(ck, capsys)
    # THEN one line refuses the link by its name, exit 2, and nothing of the file it points to is shown
    assert code == 2
    assert line == f"{_where(ck)}: its {name!r} {LINKED}"
    assert "SECRET" not in line and str(outside) not in line


@pytest.mark.subprocess
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "scaler.pt"])
def test_a_fifo_in_the_checkpoint_is_refused_without_waiting_on_it(ck: Path, name: str) -> None:
    # GIVEN a checkpoint whose file `name` is a FIFO that nobody writes (reading it would wait forever)
    if (ck / name).exists():
        (ck / name).unlink()
    os.mkfifo(ck / name)
    # WHEN it is replayed (in a process of its own, stopped after a minute if it hangs)
    done = subprocess.run([sys.executable, "-m", "nanhunt", "replay", str(ck), str(ck.parent / "batch.pt"),
                           "--no-bisect"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    # THEN it returns at once with one line naming the FIFO: exit 2
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("nanhunt:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines == [f"{_where(ck)}: its {name!r} {NOT_REGULAR}"], done.stderr


# ------------------------------------------------------------------ sizes bounded before anything is built
@pytest.fixture
def config_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' GPT2Config.from_dict fails the test if called: what it would build from the config (label
    maps, per-layer lists) must be refused before."""
    def built(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("transformers was given the config")

    monkeypatch.setattr(transformers.GPT2Config, "from_dict", classmethod(built))


@pytest.mark.parametrize("changes, said", [
    ({"num_labels": 50_000_000}, "names 50,000,000 labels (num_labels), more than the 131,072 nanhunt lets "
                                 "transformers make label maps of"),
    ({"id2label": {str(i): f"L{i}" for i in range(200_000)}},
     "names 200,000 labels (id2label), more than the 131,072 nanhunt lets transformers make label maps of"),
    ({"n_layer": 1_000_000_000}, "names 1,000,000,000 layers (n_layer), more than the 28 tensors its weights hold"),
    ({"vocab_size": 10**12}, "names a vocabulary of 1,000,000,000,000 (vocab_size), more than the 28,032 values "
                             "its weights hold"),
], ids=["num_labels", "id2label", "layers", "vocabulary"])
def test_a_config_size_is_bounded_before_transformers_sees_the_config(
        ck: Path, capsys: pytest.CaptureFixture[str], config_untouched: None, changes: dict[str, Any],
        said: str) -> None:
    # GIVEN a checkpoint whose config.json names 50 M labels (transformers would build 6 GB of label maps from the
    # number alone), 200,000 of them, a billion layers or a vocabulary of 10**12
    _config(ck, **changes)
    # WHEN it is replayed  THEN one line refuses it, before transformers is given the config
    code, line = _replay(ck, capsys)
    assert code == 2
    assert line == f"{_where(ck)}: its config.json {said}; {CONFIG_FIX}"


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_a_real_small_checkpoint_fits_the_bounds(tmp_path: Path, name: str) -> None:
    # GIVEN a small Llama or Qwen2 as save_pretrained writes it (Qwen2's config holds max_window_layers, 28, a
    # bound on its layers and not a count of them) and a batch
    cls = getattr(transformers, name)
    config = cls.config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "checkpoint-1")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": ids, "labels": ids}, tmp_path / "batch.pt")
    # WHEN it is loaded  THEN it is the model its config names
    from nanhunt.capture.capture import load_step

    step = load_step(str(tmp_path / "checkpoint-1"), str(tmp_path / "batch.pt"), dtype="float32")
    assert type(step.model) is cls


def test_empty_tensors_do_not_count_as_layers(ck: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a checkpoint whose weights' header adds 15,000 empty tensors (no data) and whose config names
    # 15,000 layers: one tensor a layer, if an empty one counted
    header, data = _header(ck / "model.safetensors")
    header.update({f"pad.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(15_000)})
    _write_header(ck / "model.safetensors", header, data)
    _config(ck, n_layer=15_000)

    def built(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "__init__", built)
    # WHEN it is replayed  THEN it is refused before any model is built, counting the 28 tensors with data
    code, line = _replay(ck, capsys)
    assert code == 2
    assert line == (f"{_where(ck)}: its config.json names 15,000 layers (n_layer), more than the 28 tensors its "
                    f"weights hold (15,000 more are empty); {CONFIG_FIX}")


def test_views_that_would_grow_far_beyond_the_file_once_copied_are_refused(ck: Path) -> None:
    # GIVEN an optimizer.pt of 0.2 MiB whose four exp_avg are stride-0 views of 0.7 GiB each (the snapshot copies
    # each whole: 2.8 GiB), each alone within the bound on one view
    sd = torch.load(ck / "optimizer.pt", weights_only=True)
    for i in range(4):
        sd["state"][i]["exp_avg"] = torch.zeros(1).expand(int(0.7 * 2**30) // 4)
    torch.save(sd, ck / "optimizer.pt")
    assert (ck / "optimizer.pt").stat().st_size < 2**20
    # WHEN it is loaded  THEN it is refused in one line, before anything is copied
    with pytest.raises(InputError) as info:
        load_file(str(ck / "optimizer.pt"), what="optimizer")
    assert str(info.value) == (
        f"optimizer {str(ck / 'optimizer.pt')!r} holds tensors that would take 3,006,674,848 bytes once copied, "
        "from 197,760 bytes of data (views repeat their data: a stride-0 view, several views of one tensor); "
        "nanhunt takes views up to twice their data or 1 GiB beyond it, whichever is more; save the tensors "
        "themselves (.clone())")


# ------------------------------------------------------------------ a safetensors shape torch cannot hold
@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_a_shape_torch_cannot_hold_is_refused_in_one_line(ck: Path, capsys: pytest.CaptureFixture[str],
                                                          command: str) -> None:
    # GIVEN weights with an empty tensor of shape [0, 2**63] (0 bytes, and a size past torch's int64)
    weights = ck / "model.safetensors"
    header, data = _header(weights)
    header["x"] = {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}
    _write_header(weights, header, data)
    # WHEN it is replayed, or inspected
    argv = ["replay", str(ck), str(ck.parent / "batch.pt")] if command == "replay" else ["inspect", str(weights)]
    code = main(argv)
    err = capsys.readouterr().err
    # THEN one line refuses it: exit 2
    lines = [ln for ln in err.splitlines() if ln.startswith("nanhunt:")]
    assert code == 2 and "Traceback" not in err, err
    what = f"Trainer checkpoint {str(ck)!r}: its weights" if command == "replay" else "checkpoint"
    assert lines == [f"nanhunt: error: {what} {str(weights)!r} is not a readable safetensors file: its tensor 'x' "
                     "has a shape [0, 9223372036854775808], which torch cannot hold (at most 64 sizes, each below "
                     "2**63)"], err


# ------------------------------------------------------------------ damaged states are bad input
@pytest.mark.parametrize("name, state, said", [
    ("rng_state.pth", {"cpu": torch.zeros(torch.get_rng_state().shape, dtype=torch.uint8)},
     "its rng_state.pth holds a torch generator state ('cpu') that torch refuses (Invalid mt19937 state): the "
     "file is damaged; delete it to replay from nanhunt's own generator state"),
    ("scaler.pt", {**torch.amp.GradScaler("cpu").state_dict(), "scale": "abc"},
     "its scaler.pt holds a GradScaler state torch cannot use (its 'scale' is 'abc', not a number): the file is "
     "damaged; delete it, or pass --no-scaler to replay without it"),
    ("scaler.pt", {**torch.amp.GradScaler("cpu").state_dict(), "_growth_tracker": 2**40},
     "its scaler.pt holds a GradScaler state torch cannot use (its '_growth_tracker' is 1099511627776, not a "
     "count below 2**31): the file is damaged; delete it, or pass --no-scaler to replay without it"),
], ids=["rng", "scale", "tracker"])
def test_a_damaged_generator_or_scaler_state_is_bad_input(ck: Path, capsys: pytest.CaptureFixture[str], name: str,
                                                          state: dict[str, Any], said: str) -> None:
    # GIVEN a checkpoint whose rng_state.pth or scaler.pt holds a state torch cannot use
    torch.save(state, ck / name)
    # WHEN it is replayed  THEN one line names the file and the fix: exit 2, not "a nanhunt bug"
    code, line = _replay(ck, capsys)
    assert code == 2
    assert line == f"{_where(ck)}: {said}"


def test_a_nanhunt_capture_whose_batch_holds_a_damaged_generator_state_is_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a nanhunt capture whose batch file's generator state has the right shape and not a valid state
    import nanhunt

    ck, bt = tmp_path / "checkpoint.pt", tmp_path / "batch.pt"
    nanhunt.save_capture(ck, bt, model=torch.nn.Linear(2, 2), batch=(torch.ones(1, 2), torch.ones(1, 2)),
                         loss_fn=torch.nn.functional.mse_loss, dtype=torch.float32)
    data = torch.load(bt, weights_only=True)
    data["rng"]["torch"] = torch.zeros_like(data["rng"]["torch"])
    torch.save(data, bt)
    # WHEN it is replayed  THEN one line names the batch file: exit 2
    code = main(["replay", str(ck), str(bt), "--no-bisect"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"nanhunt: error: batch {str(bt)!r} is not a valid nanhunt capture: field 'rng' holds a torch generator "
        "state that torch refuses (Invalid mt19937 state); save the capture again (nanhunt.save_capture)")


# ------------------------------------------------------------------ transformers' log stays off the terminal
@pytest.mark.subprocess
def test_what_transformers_logs_while_nanhunt_builds_the_config_never_reaches_the_terminal(ck: Path) -> None:
    # GIVEN a config whose extra key (a terminal escape, then a forged error line) names a token id past the
    # vocabulary: transformers warns about it, the key's name written as it is
    _config(ck, **{"x\x1b[2J\x1b[31m\nnanhunt: error: forged_token_id": 10**6})
    # WHEN it is replayed (in a process of its own: transformers logs to the stderr it found when imported)
    done = subprocess.run([sys.executable, "-m", "nanhunt", "replay", str(ck), str(ck.parent / "batch.pt"),
                           "--no-bisect", "--dtype", "float32"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    # THEN the step replays, and nothing of the key reaches the terminal
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout + done.stderr and "forged" not in done.stdout + done.stderr, done.stderr


def test_transformers_verbosity_is_restored_when_the_config_fails(ck: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN transformers at its info verbosity, and a config transformers refuses (a token id that is no integer)
    logger = logging.getLogger("transformers")
    monkeypatch.setattr(logger, "level", logging.INFO)
    _config(ck, bos_token_id="one")
    # WHEN it is replayed  THEN it is refused in one line, and transformers' verbosity is as it was
    code, line = _replay(ck, capsys)
    assert code == 2 and line.startswith("nanhunt: error: cannot build transformers.models.gpt2."), line
    assert logger.level == logging.INFO
