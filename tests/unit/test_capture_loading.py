"""Loading captures: state-dict prefix mapping and per-module train flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt._util._errors import InputError
from nanhunt.capture.capture import load_step, map_state_dict

from tests._support.cli import FrozenBNNet
from tests._support.models import clean_mlp


@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.", "module._orig_mod."])
def test_map_state_dict_ddp_and_compile_prefixes_and_one_error_for_a_missing_key(prefix: str) -> None:
    m = clean_mlp()
    sd = m.state_dict()
    out = map_state_dict({prefix + k: v for k, v in sd.items()}, m)
    assert sorted(out) == sorted(sd) and all(out[k] is sd[k] for k in sd)
    with pytest.raises(InputError, match="missing fc2.bias"):
        map_state_dict({prefix + k: v for k, v in sd.items() if k != "fc2.bias"}, m)


@pytest.mark.parametrize("train", [None, True, False])
def test_load_step_per_module_flags(train: bool | None, tmp_path: Path) -> None:
    m = FrozenBNNet().train()
    m.bn.eval()
    x, y = torch.randn(4, 4), torch.zeros(4, 4)
    nanhunt.save_capture(tmp_path / "ck.pt", tmp_path / "b.pt", model=m, batch=(x, y), loss_fn=F.mse_loss,
                         model_factory="tests._support.cli:FrozenBNNet")
    step = load_step(str(tmp_path / "ck.pt"), str(tmp_path / "b.pt"), train=train)
    flags = {n: mod.training for n, mod in step.model.named_modules()}
    if train is False:
        assert not any(flags.values())
    else:
        assert flags == {"": True, "fc": True, "bn": False}
