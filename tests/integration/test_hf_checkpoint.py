"""The checkpoints a ``transformers.Trainer`` writes (``checkpoint-N/``) and ``.safetensors`` files, replayed as they are.

A tiny GPT-2 (built from a config, nothing downloaded) is trained two steps by a real Trainer that saves after each;
a callback multiplies block 1's MLP projection by 5e4 as step 2 ends, so ``checkpoint-2`` holds weights whose float16
``addmm`` overflows there (tests/real/test_hf_transformers.py works the fault out) and ``checkpoint-1`` clean ones.
``nanhunt replay checkpoint-N batch.pt`` replays either with no other argument. Damaged or hostile directories and
safetensors files are refused in one line, before anything they claim is allocated.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt import Phase
from nanhunt.capture.capture import load_step
from nanhunt.cli import main
from nanhunt.records import Report
from tests._support.cli import HotNet, Output
from tests.real import builders as B
from tests.real.builders import where

pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
C_PROJ = "transformer.h.1.mlp.c_proj"
ASSUMED_ADAMW = "optimizer.pt replayed as torch.optim.AdamW, the Trainer's default"
ASSUMED_FP16 = "replayed in float16 autocast"  # what an older nanhunt guessed where the checkpoint did not say


def _args_say(ck: Path, **kw: Any) -> None:
    """Replace the checkpoint's training_args.bin with one of a run made with ``kw`` (fp16=True, bf16=True)."""
    torch.save(TrainingArguments(output_dir=str(ck.parent), use_cpu=True, report_to=[], **kw),
               ck / "training_args.bin")


class _HotProjection(TrainerCallback):
    """Multiplies block 1's MLP projection by 5e4 as step 2 ends, before the Trainer saves checkpoint-2."""

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step == 2:
            B.scale_weight(model, C_PROJ, 5e4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Path]:
    """The Trainer after two steps, and its output directory (checkpoint-1 clean, checkpoint-2 hot)."""
    out = tmp_path_factory.mktemp("trainer")
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(1, 64, (8, 8), generator=g)]
    args = TrainingArguments(output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=2,
                             weight_decay=0.01, lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             disable_tqdm=True, logging_strategy="no", seed=0)
    tr = Trainer(model=B.gpt2_eager(), args=args, train_dataset=data, callbacks=[_HotProjection()])
    tr.train()
    return tr, out


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The next step's batch, as a user saves it: the model's keyword arguments, labels included."""
    path = tmp_path_factory.mktemp("batch") / "batch.pt"
    torch.save(B.lm_batch(), path)
    return path


def _copy(trained: tuple[Trainer, Path], step: int, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained[1] / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}"))


def _replayed(argv: list[str], tmp_path: Path) -> tuple[int, Report]:
    out = tmp_path / "report.json"
    rc = main(["replay", *argv, "--report", str(out)])
    return rc, Report.from_json(out.read_text())


def _one_error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``nanhunt ARGV`` exits 2 with one ``nanhunt: error:`` line and no traceback (warnings aside)."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith(("warning:", "["))]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("nanhunt: error:"), err
    return lines[0]


def _by_name(model: torch.nn.Module, opt: torch.optim.Optimizer, key: str) -> dict[str, torch.Tensor]:
    return {n: opt.state[p][key] for n, p in model.named_parameters()}


# ------------------------------------------------------------------ replayed as the Trainer left it
def test_a_trainer_checkpoint_replays_with_no_other_argument_in_the_precision_the_run_used(
        trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-2 as the Trainer wrote it (config.json, model.safetensors, optimizer.pt, scheduler.pt,
    # rng_state.pth, trainer_state.json, training_args.bin) of a float32 run (neither fp16 nor bf16), whose block-1
    # projection overflows float16 but not float32
    ck = trained[1] / "checkpoint-2"
    assert {"config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "training_args.bin"} <= {
        p.name for p in ck.iterdir()}
    step = load_step(str(ck), str(batch))
    B.assert_overflows_only_in_fp16(step.model, C_PROJ, B.lm_batch())
    # THEN it is replayed as the run ran, in float32 (training_args.bin says so), with what the file says of its
    # learning rate
    assert step.dtype == torch.float32
    assert any("training_args.bin says learning_rate=5e-05" in n and "max_grad_norm=1.0" in n for n in step.notes)
    del step
    # WHEN it is replayed with its batch and nothing else
    rc, rep = _replayed([str(ck), str(batch)], tmp_path)
    # THEN no float16 overflow is headlined: the run did not use float16, and its step is finite
    assert (rc, rep.status, rep.first) == (0, "clean", None)
    assert rep.config["dtype"] == "float32"
    assert not any(ASSUMED_FP16 in n for n in rep.notes), rep.notes


def test_a_float16_run_names_the_overflowing_layer(trained: tuple[Trainer, Path], batch: Path,
                                                  tmp_path: Path) -> None:
    # GIVEN checkpoint-2 as a float16 run on an accelerator leaves it: training_args.bin with fp16=True, and the
    # scaler.pt such a run saves
    ck = _copy(trained, 2, tmp_path)
    _args_say(ck, fp16=True)
    torch.save(torch.amp.GradScaler("cpu", init_scale=1.0).state_dict(), ck / "scaler.pt")
    # WHEN it is replayed with its batch and nothing else
    rc, rep = _replayed([str(ck), str(batch)], tmp_path)
    # THEN the Inf is born in that projection's addmm, and float32 there alone makes the step finite
    assert rc == 1 and rep.config["dtype"] == "float16"
    assert where(rep.first) == (Phase.FORWARD, C_PROJ, "aten::addmm", 0, "inf")
    assert rep.verdict is not None and (rep.verdict.kind, rep.verdict.culprits) == ("precision", (C_PROJ,))
    # AND what the checkpoint does not say is said: AdamW was assumed
    assert any(ASSUMED_ADAMW in n for n in rep.notes), rep.notes


@pytest.mark.parametrize("args, scaler, expected, said", [
    ({"bf16": True}, False, torch.bfloat16, None),
    ({"fp16": True}, True, torch.float16, None),
    ({"fp16": True}, False, torch.float32, "says fp16=True, but no scaler.pt was saved"),
    ({}, True, torch.float32, None),  # a float32 run: the scaler.pt of a disabled GradScaler means nothing more
    (None, True, torch.float16, None),  # no training_args.bin: only float16 needs a GradScaler
])
def test_the_precision_is_read_from_what_the_checkpoint_holds(
        trained: tuple[Trainer, Path], batch: Path, tmp_path: Path, args: dict[str, bool] | None, scaler: bool,
        expected: torch.dtype, said: str | None) -> None:
    ck = _copy(trained, 1, tmp_path)
    if args is None:
        (ck / "training_args.bin").unlink()
    else:
        _args_say(ck, **args)
    if scaler:
        torch.save(torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict(), ck / "scaler.pt")
    step = load_step(str(ck), str(batch))
    assert step.dtype == expected
    assert said is None or any(said in n for n in step.notes), step.notes


def test_a_checkpoint_that_does_not_say_its_precision_asks_for_it(
        trained: tuple[Trainer, Path], batch: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN checkpoint-1 without training_args.bin nor scaler.pt, its weights float32
    ck = _copy(trained, 1, tmp_path)
    (ck / "training_args.bin").unlink()
    # WHEN it is replayed THEN one line asks for --dtype, instead of a replay in a guessed precision
    line = _one_error_line(["replay", str(ck), str(batch)], capsys)
    assert "does not say which precision the run used" in line and "--dtype float32" in line
    # AND --dtype is what it says
    assert load_step(str(ck), str(batch), dtype="bfloat16").dtype == torch.bfloat16


def test_the_model_optimizer_and_rng_come_back_as_the_trainer_held_them(
        trained: tuple[Trainer, Path], batch: Path) -> None:
    # GIVEN the Trainer that wrote checkpoint-2 as its last state (decay and no-decay groups, fused AdamW)
    tr, out = trained
    # WHEN the checkpoint is loaded
    step = load_step(str(out / "checkpoint-2"), str(batch))
    # THEN the model is the config's GPT-2 with the Trainer's weights (the tied head too)
    assert type(step.model) is GPT2LMHeadModel and step.loss_fn is None
    mine, theirs = step.model.state_dict(), tr.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert step.model.lm_head.weight is step.model.transformer.wte.weight
    # AND the optimizer's groups and moments are the Trainer's, parameter by parameter
    assert isinstance(step.optimizer, torch.optim.AdamW) and tr.optimizer is not None
    assert [[n for n, p in step.model.named_parameters() if any(p is q for q in g["params"])]
            for g in step.optimizer.param_groups] == [
        [n for n, p in tr.model.named_parameters() if any(p is q for q in g["params"])]
        for g in tr.optimizer.param_groups]
    assert [g["weight_decay"] for g in step.optimizer.param_groups] == [0.01, 0.0]
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = _by_name(step.model, step.optimizer, key), _by_name(tr.model, tr.optimizer, key)
        assert all(torch.equal(a[n], b[n]) for n in b)
    # AND the step starts from the generator state the Trainer saved, with no autocast, as its training_args.bin says
    saved = torch.load(out / "checkpoint-2" / "rng_state.pth", weights_only=False)  # this test's own file
    assert step.rng is not None and torch.equal(step.rng["torch"], saved["cpu"])
    assert (step.dtype, step.scaler) == (torch.float32, None)


def test_a_clean_checkpoint_replays_clean(trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-1, before the projection was made hot
    # WHEN it is replayed
    rc, rep = _replayed([str(trained[1] / "checkpoint-1"), str(batch), "--no-bisect"], tmp_path)
    # THEN the step, its update included, stays finite
    assert (rc, rep.status, rep.first) == (0, "clean", None)
    assert "update" in {phase for _, phase, _, _ in rep.timeline}


def test_sharded_weights_load_as_one(trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-2 with its weights in shards and model.safetensors.index.json (save_pretrained's own)
    tr, _ = trained
    ck = _copy(trained, 2, tmp_path)
    (ck / "model.safetensors").unlink()
    tr.model.save_pretrained(ck, max_shard_size="20KB")
    assert len(list(ck.glob("model-*-of-*.safetensors"))) > 1 and (ck / "model.safetensors.index.json").is_file()
    # WHEN it is loaded
    step = load_step(str(ck), str(batch))
    # THEN the weights are the Trainer's
    mine, theirs = step.model.state_dict(), tr.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_a_grad_scaler_beside_the_checkpoint_means_float16_with_its_scale(
        trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-1 of an fp16 run on a GPU: fp16=True and the scaler.pt it saves
    ck = _copy(trained, 1, tmp_path)
    _args_say(ck, fp16=True)
    torch.save(torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict(), ck / "scaler.pt")
    # WHEN it is loaded
    step = load_step(str(ck), str(batch))
    # THEN the step runs in float16 autocast with that scale
    assert step.dtype == torch.float16 and step.scaler is not None and step.scaler.get_scale() == 1024.0


def test_bfloat16_weights_stay_bfloat16_and_mean_bfloat16_autocast(
        trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-1 with its weights saved in bfloat16 (a model loaded and trained in bfloat16) and no
    # training_args.bin to say more
    from safetensors.torch import load_file, save_file

    ck = _copy(trained, 1, tmp_path)
    weights = load_file(ck / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, ck / "model.safetensors")
    (ck / "training_args.bin").unlink()
    # WHEN it is loaded
    step = load_step(str(ck), str(batch))
    # THEN the model holds them as they are, and the autocast is bfloat16
    assert {p.dtype for p in step.model.parameters()} == {torch.bfloat16}
    assert step.dtype == torch.bfloat16


def test_model_optimizer_and_dtype_given_on_the_command_line_are_used(
        trained: tuple[Trainer, Path], batch: Path) -> None:
    # GIVEN checkpoint-2 and --model, --optimizer, --dtype
    tr, out = trained
    # WHEN it is loaded with them
    step = load_step(str(out / "checkpoint-2"), str(batch), model_factory="tests.real.builders:gpt2_eager",
                     optimizer="torch.optim:Adam", dtype="bfloat16")
    # THEN they are what the step uses, with the checkpoint's weights, and nothing is said to be assumed
    assert step.model.config._attn_implementation == "eager"  # the factory's model, not the config's default
    mine, theirs = step.model.state_dict(), tr.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert step.dtype == torch.bfloat16 and type(step.optimizer) is torch.optim.Adam
    assert not any(ASSUMED_ADAMW in n or ASSUMED_FP16 in n for n in step.notes), step.notes


def test_optimizer_groups_that_are_not_the_trainers_are_said_and_not_replayed(
        trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-1 whose optimizer.pt holds one group of the 10 parameters with weight decay
    ck = _copy(trained, 1, tmp_path)
    sd = torch.load(ck / "optimizer.pt", weights_only=True)
    sd["param_groups"] = sd["param_groups"][:1]
    torch.save(sd, ck / "optimizer.pt")
    # WHEN it is loaded
    step = load_step(str(ck), str(batch))
    # THEN it has no optimizer, and says why
    assert step.optimizer is None
    assert f"Trainer checkpoint {str(ck)!r}: the groups of its optimizer.pt (10 parameters) are not the Trainer's (10 " \
           "with weight decay, 18 without): phase update not replayed" in step.notes, step.notes


def test_an_rng_state_written_under_numpy_1_is_read(trained: tuple[Trainer, Path], batch: Path,
                                                     tmp_path: Path) -> None:
    # GIVEN checkpoint-1 whose rng_state.pth names NumPy's array constructor as NumPy 1 did (numpy.core)
    ck = _copy(trained, 1, tmp_path)
    saved = torch.load(ck / "rng_state.pth", weights_only=False)  # this test's own file
    torch.save(saved, tmp_path / "protocol2.pth", pickle_protocol=2)  # names as text: "c<module>\n<name>\n"
    with zipfile.ZipFile(tmp_path / "protocol2.pth") as src, zipfile.ZipFile(ck / "rng_state.pth", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                assert b"cnumpy._core.multiarray\n" in data
                data = data.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
            dst.writestr(info, data)
    # WHEN it is loaded
    step = load_step(str(ck), str(batch))
    # THEN its torch generator state is the step's
    assert step.rng is not None and torch.equal(step.rng["torch"], saved["cpu"])


def test_the_generator_state_of_rank_0_is_taken_when_each_rank_saved_its_own(
        trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-1 as two processes save it: rng_state_0.pth and rng_state_1.pth, no rng_state.pth
    ck = _copy(trained, 1, tmp_path)
    saved = torch.load(ck / "rng_state.pth", weights_only=False)  # this test's own file
    (ck / "rng_state.pth").rename(ck / "rng_state_0.pth")
    torch.save({**saved, "cpu": torch.Generator().manual_seed(1).get_state()}, ck / "rng_state_1.pth")
    # WHEN it is loaded
    step = load_step(str(ck), str(batch))
    # THEN the step starts from rank 0's, and says so
    assert step.rng is not None and torch.equal(step.rng["torch"], saved["cpu"])
    assert f"Trainer checkpoint {str(ck)!r} was saved by several processes: the step starts from rank 0's generator " \
           "state (rng_state_0.pth)" in step.notes, step.notes


@pytest.mark.parametrize("case", ["pickled objects", "no generator state"])
def test_an_rng_state_that_cannot_be_used_is_said_and_left_out(
        case: str, trained: tuple[Trainer, Path], batch: Path, tmp_path: Path) -> None:
    # GIVEN checkpoint-1 whose rng_state.pth holds an object of a class, or no torch generator state
    ck = _copy(trained, 1, tmp_path)
    cpu = torch.get_rng_state()
    state = ({"cpu": cpu, "python": Output(cpu, cpu)} if case == "pickled objects" else {"cpu": cpu[:8]})
    torch.save(state, ck / "rng_state.pth")
    # WHEN it is loaded
    step = load_step(str(ck), str(batch))
    # THEN the step has no RNG state of its own, and a note says why
    assert step.rng is None
    why = ("holds pickled Python objects (tests._support.cli.Output), which run code when loaded; if you trust its "
           "source, rerun with --trust-pickle" if case == "pickled objects" else
           "holds no torch generator state ('cpu')")
    assert any(why in n and n.endswith("not used: the step starts from nanhunt's own generator state")
               for n in step.notes), step.notes


# ------------------------------------------------------------------ checkpoints nanhunt refuses
def _header(path: Path, header: dict[str, Any], data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _terabyte_tensor(ck: Path) -> None:
    _header(ck / "model.safetensors", {"transformer.wte.weight": {
        "dtype": "F32", "shape": [2**20, 2**18], "data_offsets": [0, 2**40]}})


def _huge_header(ck: Path) -> None:
    with open(ck / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", 100 << 20) + b"{")
        f.truncate(8 + (100 << 20))  # sparse: the file is as long as its header claims


def _index(weight_map: dict[str, str]) -> Any:
    def write(ck: Path) -> None:
        (ck / "model.safetensors").unlink()
        (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return write


def _config(**changes: Any) -> Any:
    def write(ck: Path) -> None:
        cfg = json.loads((ck / "config.json").read_text())
        (ck / "config.json").write_text(json.dumps({**cfg, **changes}))
    return write


def _llava_config(ck: Path) -> None:
    """A vision-language model whose text model (a sub-config) has a million layers."""
    (ck / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": {"model_type": "llama", "num_hidden_layers": 1_000_000}}))


def _fsdp_shards(ck: Path) -> None:
    (ck / "model.safetensors").unlink()
    (ck / "pytorch_model_fsdp_0").mkdir()
    (ck / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"")


def _zero_partitions(ck: Path) -> None:
    (ck / "model.safetensors").unlink()
    (ck / "global_step1").mkdir()
    (ck / "latest").write_text("global_step1")


def _sgd_state(ck: Path) -> None:
    sd = torch.load(ck / "optimizer.pt", weights_only=True)
    sd["state"] = {i: {"momentum_buffer": s["exp_avg"]} for i, s in sd["state"].items()}
    torch.save(sd, ck / "optimizer.pt")


REFUSED = {
    "a tensor of a terabyte": (_terabyte_tensor, "claims bytes 0 to 1,099,511,627,776 of the data, and the file "
                                                 "holds 0: it is truncated or hostile; nanhunt allocates nothing"),
    "a header of 100 MB": (_huge_header, "has a safetensors header of 100.0 MiB; a header spends some 100 bytes a "
                                         "tensor, and nanhunt reads at most 16 MiB of one"),
    "an index naming a file outside": (_index({"transformer.wte.weight": "../../etc/passwd"}),
                                       "names '../../etc/passwd' as a shard, which is not the name of a .safetensors "
                                       "file inside the checkpoint"),
    "an index naming a missing shard": (_index({"transformer.wte.weight": "model-00002-of-00002.safetensors"}),
                                        "names the shard 'model-00002-of-00002.safetensors', which is not there"),
    "a config far larger than its weights": (_config(n_embd=4096), "does not fit its weights (shape mismatch "
                                                                   "transformer.wte.weight (64, 32) in the weights vs "
                                                                   "(64, 4096), "),
    # (each layer holds weights: more layers than the weights hold tensors is refused before any is built)
    "a config of a million layers": (_config(n_layer=1_000_000),
                                     "its config.json names 1,000,000 layers (n_layer), more than the 28 tensors "
                                     "its weights hold; the config does not belong to them: pass --model "
                                     "package.module:factory"),
    "a vision-language config of a million text layers": (_llava_config, "its config.json names 1,000,000 layers "
                                                                         "(num_hidden_layers), more than the 28 "
                                                                         "tensors its weights hold"),
    "a config asking for remote code": (_config(auto_map={"AutoModel": "evil.Model"}),
                                        "its config asks to fetch something (auto_map)"),
    "FSDP shards": (_fsdp_shards, "holds its weights as FSDP shards (pytorch_model_fsdp_0/), not model.safetensors; "
                                  "merge them into one with accelerate merge-weights "),
    "DeepSpeed partitions": (_zero_partitions, "holds its weights as DeepSpeed ZeRO partitions (global_step*/), not "
                                               "model.safetensors; gather them into one with python -m "
                                               "deepspeed.utils.zero_to_fp32 "),
    "optimizer state that is not AdamW's": (_sgd_state, "its optimizer.pt holds state (momentum_buffer) that is not "
                                                        "AdamW's, the Trainer's default; pass --optimizer"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_checkpoint_that_is_damaged_hostile_or_not_readable_here_is_refused_in_one_line(
        case: str, trained: tuple[Trainer, Path], batch: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN checkpoint-1 with one file replaced
    make, said = REFUSED[case]
    ck = _copy(trained, 1, tmp_path)
    make(ck)
    # WHEN it is replayed
    line = _one_error_line(["replay", str(ck), str(batch)], capsys)
    # THEN one line says what is wrong with it
    assert said in line, line


def test_a_checkpoint_directory_without_its_batch_asks_for_it(
        trained: tuple[Trainer, Path], capsys: pytest.CaptureFixture[str]) -> None:
    ck = str(trained[1] / "checkpoint-1")
    line = _one_error_line(["replay", ck], capsys)
    assert line == (f"nanhunt: error: {ck!r} is a Trainer checkpoint directory, which replays with the batch of the "
                    "step to replay: nanhunt replay DIR batch.pt (a .pt of the model's keyword arguments, labels "
                    "included)")


def test_a_checkpoint_directory_where_a_file_is_expected_says_what_it_is(
        trained: tuple[Trainer, Path], capsys: pytest.CaptureFixture[str]) -> None:
    ck = str(trained[1] / "checkpoint-1")
    line = _one_error_line(["inspect", ck], capsys)
    assert line == (f"nanhunt: error: checkpoint {ck!r} is a transformers checkpoint directory, not a file; replay it "
                    f"with the batch of its next step (nanhunt replay {ck} batch.pt), or give one of its files (its "
                    "model.safetensors)")


# ------------------------------------------------------------------ a .safetensors file
def test_a_safetensors_file_is_read_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN HotNet's weights (fc2 overflows float16: tests/integration/test_cli_checkpoints.py) as a
    # .safetensors file, and its batch
    from safetensors.torch import save_file

    m = HotNet()
    with torch.no_grad():
        m.fc1.weight.copy_(torch.eye(m.fc1.in_features))
        m.fc1.bias.zero_()
        m.fc2.weight.fill_(2.0**15)
        m.fc2.bias.zero_()
    save_file(m.state_dict(), tmp_path / "weights.safetensors")
    d = m.fc1.in_features
    torch.save((torch.ones(2, d), torch.zeros(2, d)), tmp_path / "batch.pt")
    monkeypatch.chdir(ROOT)
    # WHEN it is replayed with --model
    rc, rep = _replayed([str(tmp_path / "weights.safetensors"), str(tmp_path / "batch.pt"), "--model",
                         "tests._support.cli:HotNet", "--loss", "torch.nn.functional:mse_loss", "--no-bisect"],
                        tmp_path)
    # THEN its weights are replayed: fc2's addmm overflows
    assert rc == 1 and rep.first is not None and (rep.first.module, rep.first.op) == ("fc2", "aten::addmm")


def test_a_safetensors_file_without_model_asks_for_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    torch.save(torch.ones(2), tmp_path / "batch.pt")
    line = _one_error_line(["replay", str(tmp_path / "w.safetensors"), str(tmp_path / "batch.pt")], capsys)
    assert line == "nanhunt: error: the checkpoint holds only weights; pass --model package.module:factory to build " \
                   "the model"


def test_a_safetensors_file_that_lies_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a safetensors file whose one tensor's offsets span fewer bytes than its shape needs
    _header(tmp_path / "w.safetensors", {"w": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 8]}}, b"\0" * 8)
    torch.save(torch.ones(2), tmp_path / "batch.pt")
    line = _one_error_line(["replay", str(tmp_path / "w.safetensors"), str(tmp_path / "batch.pt"), "--model",
                            "torch.nn:Linear"], capsys)
    assert line.endswith("its tensor 'w' (float16 of shape (4, 4), 32 bytes) has data_offsets spanning 8 bytes"), line


def test_load_capture_reads_the_checkpoint_directory(trained: tuple[Trainer, Path], batch: Path) -> None:
    step = nanhunt.load_capture(trained[1] / "checkpoint-1", batch)
    assert type(step.model) is GPT2LMHeadModel and isinstance(step.optimizer, torch.optim.AdamW)
