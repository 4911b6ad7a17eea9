"""A capture's record of how its model was built (field ``model_init``) comes from a file: replaying it builds
only the model the user confirmed, a config class only from that model's own module with the fields the class
declares, and nothing larger than the capture's weights; every refusal is one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nanhunt._util._errors import InputError
from nanhunt.capture._construction import arguments
from tests._support.config_models import HERE, Cfg, Net


def _sd(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def test_a_config_class_of_another_module_is_refused() -> None:
    # GIVEN a capture whose model (confirmed) is this module's Net but whose config class names another module
    record = {"args": [], "kwargs": {"config": {"dataclass": "subprocess:Popen", "fields": {"args": "id"}}}}
    # THEN the replay refuses to build it, in one line naming the module the user confirmed
    with pytest.raises(InputError) as e:
        arguments(record, Net, f"{HERE}:Net", "the capture", None)
    assert str(e.value) == (f"the capture: the model's config class 'subprocess:Popen' is not defined in {HERE!r}, "
                            "the module of the model you confirmed: nanhunt builds a config class only from that "
                            "module; write a function that builds the model and pass it as --model")
    # AND a name of that module that is not a dataclass defined in it is refused the same way
    for name in (f"{HERE}:Net", f"{HERE}:torch", f"{HERE}:Cfg.__init__", f"{HERE}:dataclasses"):
        record = {"args": [], "kwargs": {"config": {"dataclass": name, "fields": {}}}}
        with pytest.raises(InputError, match="is not defined in"):
            arguments(record, Net, f"{HERE}:Net", "the capture", None)


def test_a_config_field_the_class_does_not_declare_is_refused() -> None:
    record = {"args": [], "kwargs": {"config": {"dataclass": f"{HERE}:Cfg", "fields": {"width": 4, "evil": 1}}}}
    with pytest.raises(InputError) as e:
        arguments(record, Net, f"{HERE}:Net", "the capture", None)
    assert str(e.value) == ("the capture: field 'model_init' (the model's constructor arguments): argument 'config' "
                            "gives Cfg a field it does not declare ('evil'); save the capture again, or write a "
                            "function that builds the model and pass it as --model")


def test_sizes_are_bounded_by_the_weights_before_anything_is_allocated() -> None:
    small = _sd(Net(Cfg(width=4, n_layer=1)))
    huge_layers = {"args": [], "kwargs": {"config": {"dataclass": f"{HERE}:Cfg",
                                                     "fields": {"width": 4, "n_layer": 10**9}}}}
    with pytest.raises(InputError, match=r"names 1,000,000,000 layers \(n_layer\), more than the 2 tensors"):
        arguments(huge_layers, Net, f"{HERE}:Net", "the capture", small)
    wide = {"args": [], "kwargs": {"config": {"dataclass": f"{HERE}:Cfg", "fields": {"width": 100_000,
                                                                                   "n_layer": 1}}}}
    with pytest.raises(InputError, match="size mismatch|shape"):
        arguments(wide, Net, f"{HERE}:Net", "the capture", small)


@pytest.mark.parametrize("value", [{"tuple": "x"}, {"eval": "1"}, {"dtype": "os"}, [{"dict": {1: 2}}], object()])
def test_a_value_nanhunt_does_not_record_is_refused(value: Any) -> None:
    with pytest.raises(InputError, match="field 'model_init'"):
        arguments({"args": [value], "kwargs": {}}, Net, f"{HERE}:Net", "the capture", None)


MODEL_PY = '''
import dataclasses
from torch import nn


@dataclasses.dataclass
class Cfg:
    width: int = 4


class Net(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.width, config.width)

    def forward(self, x):
        return self.fc(x).sum()
'''


@pytest.mark.parametrize(("config", "said"), [
    ({"dataclass": "subprocess:Popen", "fields": {"args": ["touch", "pwned"]}},
     "the model's config class 'subprocess:Popen' is not defined in 'model', the module of the model you confirmed"),
    ({"dataclass": "model:Cfg", "fields": {"width": 4, "__class__": 1}},
     "gives Cfg a field it does not declare ('__class__')"),
])
def test_the_replay_refuses_a_hostile_model_init_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              config: dict[str, Any], said: str) -> None:
    # GIVEN a capture of the user's model.py:Net whose model_init names something else than its config
    from nanhunt.cli import main

    (tmp_path / "model.py").write_text(MODEL_PY)
    ck, bt = tmp_path / "ck.pt", tmp_path / "bt.pt"
    torch.save({"nanhunt_capture": 1, "model": {"fc.weight": torch.ones(4, 4), "fc.bias": torch.zeros(4)},
                "model_factory": "model:Net", "model_kwargs": {},
                "model_init": {"args": [], "kwargs": {"config": config}}}, ck)
    torch.save({"nanhunt_batch": 1, "inputs": torch.ones(2, 4), "targets": None}, bt)
    # WHEN it is replayed with the model confirmed
    code = main(["replay", str(ck), str(bt), "--model", f"{tmp_path / 'model.py'}:Net"])
    # THEN it exits 2 with one line naming the refusal, and nothing ran
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "pwned").exists()
