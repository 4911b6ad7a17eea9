"""The container walker: every container comes back as its own type, tensors mapped inside."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from nanhunt._util._tree import iter_tensors, map_tensors

Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _double(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t * 2)


def test_builtin_and_named_containers_keep_their_type() -> None:
    # GIVEN tensors inside an OrderedDict, a namedtuple, a dataclass (plain and frozen) and a list
    t = torch.ones(2)
    obj = OrderedDict(p=Pair(t, [t]), d=Out(t, extra=(t,)), f=Frozen(t))
    # WHEN they are mapped
    new = _double(obj)
    # THEN every container has its own type and the tensors are mapped, the original untouched
    assert type(new) is OrderedDict and type(new["p"]) is Pair and type(new["d"]) is Out and type(new["f"]) is Frozen
    assert new["p"].b[0].tolist() == [2, 2] and new["d"].logits.tolist() == [2, 2] and new["f"].x.tolist() == [2, 2]
    assert new["d"].extra[0].tolist() == [2, 2]
    assert obj["d"].logits.tolist() == [1, 1]
    assert len(list(iter_tensors(obj))) == 5


def test_unknown_objects_are_left_as_they_are() -> None:
    o = Opaque(torch.ones(1))
    assert _double([o])[0] is o


def test_transformers_containers_keep_their_type() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # GIVEN a ModelOutput (a dataclass and an OrderedDict) and a BatchEncoding (a UserDict)
    out = CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(1, 2))
    enc = transformers.BatchEncoding({"input_ids": torch.ones(1, 3, dtype=torch.long)})
    # WHEN mapped  THEN they keep their attributes and type
    new_out, new_enc = _double(out), _double(enc)
    assert type(new_out) is CausalLMOutputWithPast and new_out.logits.tolist() == [[2, 2]]
    assert new_out["loss"].item() == 2 and new_out.past_key_values is None
    assert type(new_enc) is transformers.BatchEncoding and new_enc.input_ids.tolist() == [[2, 2, 2]]
    assert list(iter_tensors(enc))[0] is enc["input_ids"]
