"""The tracer's record store on its own: records made with their statistics on the device, read back
in bulk, copies derived from their source (casts emulated), Records made on first use."""

from __future__ import annotations

import math

import torch

from nanhunt.tracing._records_store import STALE, Raw, RecordStore, cast_pair, cast_value, format_source
from nanhunt.records import Phase, Role


def _raw(t: torch.Tensor, phase: Phase = Phase.FORWARD, inputs: tuple[int, ...] = (),
         alias_of: int | None = None, op: str | None = "aten::mul") -> Raw:
    return Raw(phase, "fc", 2, op, Role.OUTPUT, t, inputs, ("m.py", 7, "forward"), alias_of=alias_of)


def test_records_are_numbered_and_filled_in_by_one_read_back() -> None:
    # GIVEN three records of different dtypes, one with a NaN
    store = RecordStore()
    a = store.add(_raw(torch.tensor([1.0, -3.0])), torch.tensor([1.0, -3.0]))
    b = store.add(_raw(torch.tensor([2.0, math.nan])), torch.tensor([2.0, math.nan]))
    c16 = torch.tensor([65504.0], dtype=torch.float16)
    c = store.add(_raw(c16), c16)
    assert (a, b, c) == (0, 1, 2)
    # THEN nothing is known before the read-back
    assert math.isnan(store.raws[a].min) and len(store.pending) == 3
    # WHEN they are read back
    store.read_back()
    # THEN each has its range; the NaN one is not finite
    assert (store.raws[a].min, store.raws[a].max) == (-3.0, 1.0)
    assert store.raws[a].finite and not store.raws[b].finite and store.raws[b].has_nan
    assert store.raws[c].max == 65504.0


def test_a_copy_is_derived_from_its_source_with_the_cast_emulated() -> None:
    # GIVEN a float32 tensor and its float16 copy (not measured: alias_of)
    store = RecordStore()
    src = torch.tensor([1.0, 70000.0])
    s = store.add(_raw(src), src)
    half = src.half()
    h = store.add(_raw(half, inputs=(s,), alias_of=s, op="aten::_to_copy"), half)
    assert len(store.pending) == 1  # only the source is measured
    store.read_back()
    # THEN the copy's max overflowed to inf, as the real cast did
    assert store.raws[h].max == math.inf == half.max().item()
    assert store.raws[h].min == 1.0


def test_blank_memory_counts_as_finite_and_is_not_measured() -> None:
    store = RecordStore()
    t = torch.empty(3)
    raw = _raw(t, op="aten::empty")
    raw.blank = True
    i = store.add(raw, t)
    assert len(store.pending) == 0
    store.read_back()
    assert (store.raws[i].min, store.raws[i].max) == (0.0, 0.0)


def test_a_non_finite_constant_is_a_scalar_written_down() -> None:
    store = RecordStore()
    t = torch.tensor(float("-inf"))
    raw = _raw(t, op="aten::lift_fresh")
    raw.constant = True
    i = store.add(raw, t)
    store.read_back()
    assert store.raws[i].nonfinite_scalar == "inf"


def test_read_back_from_an_index_leaves_earlier_records_alone() -> None:
    store = RecordStore()
    x = torch.ones(1)
    store.add(_raw(x), x)
    store.read_back()
    store.raws[0].min = -7.0  # as a reclassification or a check left it
    y = torch.zeros(1)
    store.add(_raw(y), y)
    store.read_back(1)
    assert store.raws[0].min == -7.0 and store.raws[1].max == 0.0


def test_records_are_made_once_and_again_after_forget() -> None:
    store = RecordStore()
    x = torch.tensor([2.0, 4.0])
    i = store.add(_raw(x), x)
    store.read_back()
    rec = store.record(i)
    assert (rec.index, rec.phase, rec.module, rec.call_index, rec.op) == (0, Phase.FORWARD, "fc", 2, "aten::mul")
    assert (rec.shape, rec.min, rec.max, rec.source) == ((2,), 2.0, 4.0, "m.py:7 in forward")
    assert store.record(i) is rec
    store.raws[i].phase = Phase.LOSS
    assert store.record(i) is rec  # cached until told
    store.forget(i)
    assert store.record(i).phase is Phase.LOSS


def test_zoomed_records_get_full_statistics_when_made() -> None:
    store = RecordStore(zoom=[1])
    x = torch.tensor([0.0, math.inf, math.nan])
    store.add(_raw(x), x)
    i = store.add(_raw(x), x)
    assert store.raws[0].full is None
    full = store.raws[i].full
    assert full is not None and (full.nan, full.posinf, full.zeros, full.numel) == (1, 1, 1, 3)


def test_the_last_loss_record_is_remembered() -> None:
    store = RecordStore()
    x = torch.ones(1)
    store.add(_raw(x), x)
    assert store.last_loss == -1
    store.add(_raw(x, phase=Phase.LOSS), x)
    store.add(_raw(x), x)
    assert store.last_loss == 1


def test_known_tensors_are_held_weakly_and_released() -> None:
    store = RecordStore()
    x = torch.ones(1)
    store.known[x] = (0, 0)
    assert store.known.get(x) == (0, 0) and store.kd
    store.release()
    assert store.known.get(x) is None and not store.kd
    y = torch.ones(1)
    store.known[y] = (1, 0)
    del y
    assert all(ref() is None for ref, _ in store.kd.values())


def test_a_write_into_the_storage_after_a_record_is_seen() -> None:
    from nanhunt.tracing._tensors import storage_key

    store = RecordStore()
    x = torch.ones(4)
    assert store.unwritten_since(x, 0)
    store.writes[storage_key(x)] = 3
    assert store.unwritten_since(x, 3) and not store.unwritten_since(x, 2)
    assert STALE < -1  # no version counter has it: a stale record is measured again


def test_cast_emulation_edges() -> None:
    assert cast_value(65519.0, "float16") == 65504.0
    assert cast_value(65520.0, "float16") == math.inf
    assert cast_value(1e39, "bfloat16") == math.inf
    assert cast_value(1e39, "float32") == math.inf
    assert cast_value(1.0 + 2**-10, "bfloat16") == 1.0  # nearest even
    assert cast_value(0.1, "float64") == 0.1
    assert math.isnan(cast_value(math.nan, "float16"))
    assert cast_pair(-1e6, 1.0, "float16") == (-math.inf, 1.0)
    assert format_source(None) is None
