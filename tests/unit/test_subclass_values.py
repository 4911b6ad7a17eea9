"""nanhunt._util._subclass: the plain values a tensor subclass stands for, and exact copies of it, through no op
the subclass does not run; the fused helpers of _dispatch falling back to them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nanhunt._util import _dispatch
from nanhunt._util._subclass import is_plain, local_tensor, plain_values, subclass_clone, subclass_copy
from nanhunt.tracing.stats import PendingStats, full_stats
from tests._support.subclasses import Opaque, Wrapped

aten = torch.ops.aten


class Float8Like(torch.Tensor):
    """The attributes torchao's Float8TrainingTensor has (``_data``, ``_scale``, ``_orig_dtype``), no op at all."""

    __slots__ = ["_data", "_scale", "_orig_dtype"]

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Float8Like:
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)  # type: ignore[attr-defined]
        self._data, self._scale, self._orig_dtype = data, scale, dtype
        return self  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"Float8Like does not run {func}")


class LossyClone(Wrapped):
    """A wrapper whose own clone computes anew (as NF4's quantizes again): here, adds one."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is aten.clone.default:
            return LossyClone(args[0].elem + 1)
        return super().__torch_dispatch__(func, types, args, kwargs)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> LossyClone:
        return LossyClone(inner["elem"])


def test_plain_tensors_and_parameters_are_their_own_values() -> None:
    t = torch.ones(3)
    p = nn.Parameter(torch.ones(3))
    assert is_plain(t) and is_plain(p) and plain_values(t) is t and plain_values(p) is p


def test_a_wrapper_is_valued_by_its_inner_tensor_of_its_shape_and_dtype() -> None:
    w = Wrapped(torch.tensor([1.0, -2.0]))
    assert not is_plain(w)
    got = plain_values(w)
    assert got is w.elem


def test_a_float8_training_tensor_is_valued_as_data_over_scale_in_its_dtype() -> None:
    data = torch.tensor([448.0, -7.0, 0.0]).to(torch.float8_e4m3fn)
    f = Float8Like(data, torch.tensor(0.5), torch.bfloat16)
    got = plain_values(f)
    assert got is not None and got.dtype == torch.bfloat16 and got.tolist() == [896.0, -14.0, 0.0]


def test_a_subclass_without_a_way_to_its_values_is_not_measured() -> None:
    o = Opaque(torch.eye(2, dtype=torch.int8), torch.tensor(3.0))
    assert plain_values(o) is None
    zero = local_tensor(o)  # judged finite, no magnitude
    assert (zero.tolist(), zero.dtype) == ([0.0], torch.float32)
    pending = PendingStats()
    assert pending.add(0, o) is False and pending.add(1, Wrapped(torch.tensor([math.inf]))) is True
    assert pending.read() == {0: (0.0, 0.0), 1: (math.inf, math.inf)}
    assert full_stats(o) is None


def test_a_clone_copies_the_inner_tensors_not_the_subclass_clone() -> None:
    # GIVEN a subclass whose own clone computes anew
    t = LossyClone(torch.tensor([1.0, 2.0]))
    c = subclass_clone(t)
    # THEN the copy holds exactly its values, in memory of its own
    assert type(c) is LossyClone and c.elem.tolist() == [1.0, 2.0]
    assert c.elem.data_ptr() != t.elem.data_ptr()
    # AND a copy back writes the live tensor's inner memory, exactly
    t.elem.fill_(9.0)
    subclass_copy(t, c)
    assert t.elem.tolist() == [1.0, 2.0]


def test_a_subclass_without_clone_or_copy_is_copied_through_its_parts() -> None:
    o = Opaque(torch.eye(2, dtype=torch.int8), torch.tensor(3.0))
    c = subclass_clone(o)
    o.qdata.fill_(5)
    o.scale.fill_(1.0)
    subclass_copy(o, c)
    assert o.qdata.tolist() == [[1, 0], [0, 1]] and o.scale.item() == 3.0


def test_the_fused_helpers_take_subclasses_their_kernels_refuse() -> None:
    # GIVEN a plain tensor, a Wrapped one holding an Inf and an Opaque one (neither has a fused kernel)
    plain, wrapped = torch.ones(2), Wrapped(torch.tensor([1.0, math.inf]))
    opaque = Opaque(torch.eye(2, dtype=torch.int8), torch.tensor(3.0))
    # THEN the non-finite check sees the Inf inside, and counts the unreadable one as finite
    assert _dispatch.nonfinite_kinds([plain, wrapped, opaque]) == [None, "inf", None]
    found = torch.zeros(())
    _dispatch.amp_check_and_unscale([plain, opaque], found, torch.ones(()))
    assert found.item() == 0.0
    _dispatch.amp_check_and_unscale([plain, wrapped], found, torch.ones(()))
    assert found.item() == 1.0
    # AND a fused copy copies a subclass through its parts
    dst = Opaque(torch.zeros(2, 2, dtype=torch.int8), torch.tensor(0.0))
    _dispatch.foreach_copy([torch.zeros(2), dst], [plain, opaque])
    assert dst.qdata.tolist() == [[1, 0], [0, 1]] and dst.scale.item() == 3.0
