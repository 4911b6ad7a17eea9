"""A model made of torch.nn's own classes (Sequential / ModuleList / ModuleDict of torch.nn layers): the capture
holds its layers' classes and arguments, the replay rebuilds it from them, checked; anything else asks for a
factory when the capture is set up, not when the replay fails."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt._util._errors import InputError
from nanhunt.capture.capture import load_step

from tests._support.models import ExpActivation

FACTORY = "pass model_factory='package.module:factory'"


def _save(tmp_path: Path, model: nn.Module, x: torch.Tensor, **kw: Any) -> tuple[str, str]:
    ck, bt = str(tmp_path / "ck.pt"), str(tmp_path / "bt.pt")
    nanhunt.save_capture(ck, bt, model=model, batch=(x, torch.zeros(2, 2)), loss_fn=F.mse_loss,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    return ck, bt


def test_sequential_of_torch_layers_replays_with_its_arguments(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        fc=nn.Linear(4, 8, bias=False), norm=nn.LayerNorm(8, eps=1e-3), act=nn.GELU(approximate="tanh"),
        drop=nn.Dropout(0.25), conv=nn.Unflatten(1, (1, 8)), pool=nn.Conv1d(1, 2, kernel_size=(3,), padding=1),
        flat=nn.Flatten(), out=nn.Linear(16, 2)))
    ck, bt = _save(tmp_path, model, torch.randn(2, 4))
    step = load_step(ck, bt)
    assert repr(step.model) == repr(model)
    got, want = step.model.state_dict(), model.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert step.optimizer is not None


def test_module_list_and_dict_inside_a_sequential_replay(tmp_path: Path) -> None:
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]),
                          nn.ModuleDict({"head": nn.Linear(4, 2), "emb": nn.Embedding(5, 4, padding_idx=0)}))
    step = load_step(*_save(tmp_path, model, torch.randn(2, 4)))
    assert repr(step.model) == repr(model)


@pytest.mark.parametrize(("layer", "why"), [
    (ExpActivation(), "layer '1' (ExpActivation) is not one of torch.nn's classes"),
    (nn.MultiheadAttention(4, 2), "layer '1' (MultiheadAttention) keeps no attribute for its argument 'bias'"),
])
def test_guard_and_save_capture_refuse_a_sequential_they_cannot_rebuild(tmp_path: Path, layer: nn.Module,
                                                                        why: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    message = f"cannot rebuild the model from torch.nn's classes: {why}; {FACTORY}"
    with pytest.raises(ValueError) as info:
        nanhunt.Guard(model, opt, dump_dir=tmp_path)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        _save(tmp_path, model, torch.randn(2, 4))
    assert str(info.value) == message
    nanhunt.Guard(model, opt, dump_dir=tmp_path, model_factory="tests._support.models:clean_mlp")  # a factory: accepted


def test_model_kwargs_that_do_not_rebuild_a_torch_model_are_refused(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    ck, bt = _save(tmp_path, model, torch.randn(2, 4), model_kwargs={"in_features": 4, "out_features": 2})
    assert repr(load_step(ck, bt).model) == repr(model)
    with pytest.raises(ValueError) as info:
        _save(tmp_path, model, torch.randn(2, 4), model_kwargs={"in_features": 4, "out_features": 3})
    assert str(info.value) == (f"cannot rebuild the model from torch.nn's classes: Linear(**model_kwargs) differs "
                               f"from the model; {FACTORY}")


def _many(n: int) -> dict[str, Any]:
    relu = {"class": "torch.nn.modules.activation:ReLU", "args": {}}
    return {"class": "torch.nn.modules.container:Sequential", "children": [[str(i), relu] for i in range(n)]}


@pytest.mark.parametrize(("spec", "why"), [
    ({"class": "tests._support.models:ExpActivation", "args": {}},
     "names 'tests._support.models:ExpActivation', not one of torch.nn's classes"),
    ({"class": "torch.nn.modules.linear:Linear", "args": {"in_features": 25000, "out_features": 25000}}, None),
    ({"class": "torch.nn.modules.linear:Linear", "args": {"in_features": {"x": 1}, "out_features": 2}},
     "gives 'torch.nn.modules.linear:Linear' an argument that is a dict, not a plain value"),
    ({"class": "torch.nn.modules.linear:Linear", "children": []},
     "gives children to 'torch.nn.modules.linear:Linear', which is not Sequential, ModuleList or ModuleDict"),
    (_many(4096), "nests more than 32 containers or holds more than 4096 modules"),
])
def test_a_file_s_layers_are_checked_before_anything_is_built(tmp_path: Path, spec: dict[str, Any],
                                                              why: str | None) -> None:
    ck, bt = _save(tmp_path, nn.Linear(4, 2), torch.randn(2, 4))
    saved = torch.load(ck, weights_only=True)
    saved["nn_model"] = spec
    torch.save(saved, ck)
    with pytest.raises(InputError) as info:
        load_step(ck, bt)
    text = str(info.value)
    assert "\n" not in text
    if why is None:  # sized on the meta device against the file's 2 x 4 weight: nothing allocated
        assert "weight" in text and "25000" in text, text
    else:
        assert text == (f"checkpoint {ck!r}: its torch.nn model (field 'nn_model') {why}; save the capture again "
                        "or pass --model package.module:factory")
