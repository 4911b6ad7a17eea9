"""How a capture records the way its model was built (``capture._construction``, ``capture._plain_args``) and where
a model's output holds its loss (``step._run``): constructor arguments noted as a module is built, read back from
the model, checked on the meta device, and rebuilt only from the module the user confirmed."""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from nanhunt._util._errors import InputError
from nanhunt.capture import _construction
from nanhunt.capture._construction import ConstructionLog, arguments, how_built
from nanhunt.step._run import _loss_of, loss_position
from tests._support.config_models import HERE, Cfg, Net


class Positional(nn.Module):
    def __init__(self, width, /, depth=1):  # type: ignore[no-untyped-def]
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


class Starred(nn.Module):
    def __init__(self, *sizes: int, bias: bool = True, **extra: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(sizes[0], sizes[1], bias=bias)


class Holder(nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone())


class Outer(Net):
    """A subclass calling its parent's constructor with arguments of its own making."""

    def __init__(self, width: int) -> None:
        super().__init__(Cfg(width=width, n_layer=1))


@pytest.fixture()
def log() -> Any:
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, make: Any) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, make(original))
        patched.append((owner, name, original))

    init = nn.Module.__dict__["__init__"]
    built = ConstructionLog().install(patch)
    try:
        yield built
    finally:
        built.close()
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
    assert nn.Module.__dict__["__init__"] is init and _construction._ACTIVE is None


def test_a_dataclass_config_is_recorded_as_the_model_is_built(log: ConstructionLog) -> None:
    # GIVEN the construction log of a run, WHEN a model is built from a config dataclass
    model = Net(Cfg(width=6, n_layer=3, dropout=0.25))
    # THEN its argument is recorded by name, the config as its class and fields (plain data)
    assert log.record_of(model) == ([], {"config": {"dataclass": f"{HERE}:Cfg",
                                                    "fields": {"width": 6, "n_layer": 3, "dropout": 0.25}}})
    # AND the capture's record of it is that, checked on the meta device against the model
    built = how_built(model, None, None)
    assert built.problem is None
    assert built.record == {"args": [], "kwargs": log.record_of(model)[1], "how": "recorded when it was built"}


def test_positional_and_starred_arguments_are_recorded_positionally(log: ConstructionLog) -> None:
    # GIVEN modules taking positional-only parameters, *args and **kwargs
    a = Positional(5, depth=2)
    b = Starred(3, 7, bias=False, tag="x")
    # THEN positional-only and starred values are recorded in order, the rest by name
    assert log.record_of(a) == ([5, 2], {})
    assert log.record_of(b) == ([3, 7], {"bias": False, "tag": "x"})
    assert how_built(b, None, None).record == {"args": [3, 7], "kwargs": {"bias": False, "tag": "x"},
                                               "how": "recorded when it was built"}


def test_the_outermost_constructor_is_recorded_not_the_parents(log: ConstructionLog) -> None:
    # GIVEN a subclass whose constructor builds its parent's config itself
    model = Outer(9)
    # THEN the arguments recorded are the subclass's own (what calling its class needs)
    assert log.record_of(model) == ([], {"width": 9})
    assert how_built(model, None, None).record is not None


def test_a_tensor_argument_is_not_kept_and_the_capture_says_what_to_pass(log: ConstructionLog) -> None:
    # GIVEN a module built from a tensor
    table = torch.ones(3, 3)
    gone = weakref.ref(table)
    model = Holder(table)
    del table
    gc.collect()
    # THEN the log keeps no reference to it, only why it cannot be recorded
    assert gone() is None
    assert log.record_of(model) == "argument 'table' is a Tensor (a capture holds tensors as weights only), not a " \
                                   "plain value"
    # AND the capture's construction names the problem and the fix
    built = how_built(model, None, None)
    assert built.record is None and built.problem is not None
    assert built.problem.startswith("the printed replay command cannot rebuild Holder: the arguments it was built "
                                    "with are not plain values (argument 'table' is a Tensor")
    assert "model_factory='package.module:fn'" in built.problem and "model_kwargs=" in built.problem


def test_the_log_ends_with_the_modules_and_on_close(log: ConstructionLog) -> None:
    model = Net(Cfg())
    assert log.record_of(model) is not None
    key = id(model)
    del model
    gc.collect()
    assert key not in log._seen


def test_a_guards_model_is_read_back_from_its_config_attribute() -> None:
    # GIVEN a model built outside any run (a Guard in the user's loop): nothing was logged
    model = Net(Cfg(width=5, n_layer=1, dropout=0.1))
    state = (torch.get_rng_state(), random.getstate())
    # WHEN its construction is judged
    built = how_built(model, None, None)
    # THEN its config is read back from model.config and checked on the meta device; the check drew no random
    # number of the script's
    assert built.problem is None
    assert built.record == {"args": [], "kwargs": {"config": {"dataclass": f"{HERE}:Cfg", "fields": {
        "width": 5, "n_layer": 1, "dropout": 0.1}}}, "how": "read back from the model's attributes"}
    assert torch.equal(torch.get_rng_state(), state[0]) and random.getstate() == state[1]


def test_a_model_changed_after_it_was_built_is_said_when_the_guard_is_made() -> None:
    # GIVEN a model whose layers were added after its constructor ran
    model = Net(Cfg(width=4, n_layer=1))
    model.layers.append(nn.Linear(4, 4))
    # THEN its read-back arguments do not rebuild it: the problem is said, nothing recorded
    built = how_built(model, None, None)
    assert built.record is None
    assert built.problem is not None and "Net built again with the arguments it can be given differs from the " \
                                         "model" in built.problem


def test_a_factory_or_arguments_given_are_used_as_given() -> None:
    model = Net(Cfg())
    assert how_built(model, "mypkg.models:build", None) == _construction.Construction()
    assert how_built(model, None, {"config": Cfg()}) == _construction.Construction()
    assert how_built(nn.Linear(2, 2), None, None) == _construction.Construction()  # torch.nn's own: its layers


# ------------------------------------------------------------------------------------------ replaying
def _sd(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def test_a_recorded_config_rebuilds_the_confirmed_model_checked_against_the_weights() -> None:
    model = Net(Cfg(width=6, n_layer=2, dropout=0.5))
    record = how_built(model, None, None).record
    assert record is not None
    args, kwargs = arguments(record, Net, f"{HERE}:Net", "the capture", _sd(model))
    assert args == [] and kwargs == {"config": Cfg(width=6, n_layer=2, dropout=0.5)}


# ------------------------------------------------------------------------------------------ the loss
def _scalar(x: float) -> torch.Tensor:
    return (torch.tensor(x, requires_grad=True) * 2).sum()


def test_the_loss_is_found_in_a_tuple_list_or_dict() -> None:
    logits = torch.ones(2, 3, requires_grad=True) * 1
    loss = _scalar(1.0)
    assert _loss_of((logits, loss), None, None) is loss
    assert _loss_of([logits, loss], None, None) is loss
    assert _loss_of({"logits": logits, "nll": loss}, None, None) is loss
    # the backward's node tells which element it is
    assert loss_position((logits, loss), loss.grad_fn) == (1,)
    assert loss_position({"logits": logits, "nll": loss}, loss.grad_fn) == ("nll",)
    assert loss_position((logits, loss), logits.grad_fn) is None


def test_two_scalars_need_the_recorded_position() -> None:
    main, aux = _scalar(1.0), _scalar(2.0)
    with pytest.raises(InputError) as e:
        _loss_of((torch.ones(2), main, aux), None, None)
    assert str(e.value) == ("the model returned a tuple holding 2 scalars with a gradient ([1], [2]) and the capture "
                            "does not say which is the loss; give a loss function that picks it (--loss "
                            "package.module:fn, called on the model's output)")
    assert _loss_of((torch.ones(2), main, aux), None, None, (2,)) is aux
    with pytest.raises(InputError, match=r"the loss is the model's output\[5\], but the model returned a tuple"):
        _loss_of((main, aux), None, None, (5,))
