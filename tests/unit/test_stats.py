"""Statistics: on-device aminmax with one read-back, full counts, and derived casts."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanhunt.tracing.stats import PendingStats, full_stats
from nanhunt.tracing.tracer import _cast_value

_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=True, allow_infinity=True, width=32), dtype=st.sampled_from(sorted(_DT)))
def test_derived_cast_matches_torch(x: float, dtype: str) -> None:
    # a copy's min/max are derived, not measured: the derivation must equal the real cast
    want = torch.tensor([x], dtype=torch.float32).to(_DT[dtype]).double().item()
    got = _cast_value(x, dtype)
    assert (math.isnan(want) and math.isnan(got)) or want == got


def test_cast_edges() -> None:
    assert _cast_value(65519.0, "float16") == 65504.0
    assert _cast_value(65520.0, "float16") == math.inf
    assert _cast_value(-1e6, "float16") == -math.inf
    assert _cast_value(1e39, "bfloat16") == math.inf


def test_pending_reads_back_per_group() -> None:
    p = PendingStats()
    p.add(0, torch.tensor([1.0, float("nan")]))
    p.add(1, torch.tensor([-2.0, 3.0], dtype=torch.float16))
    p.add(2, torch.tensor([float("-inf"), 0.0], dtype=torch.bfloat16))
    p.add(3, torch.empty(0))
    v = p.read()
    assert math.isnan(v[0][0]) and math.isnan(v[0][1])
    assert v[1] == (-2.0, 3.0)
    assert v[2] == (-math.inf, 0.0)
    assert v[3] == (0.0, 0.0)


def test_pending_never_builds_a_graph() -> None:
    w = torch.ones(3, requires_grad=True)
    p = PendingStats()
    p.add(0, w * 2)
    assert p.read()[0] == (2.0, 2.0)


def test_full_stats_counts() -> None:
    x = torch.tensor([0.0, 1e-45, 7e4, float("nan"), float("inf"), -float("inf"), -3.0])
    f = full_stats(x)
    assert (f.nan, f.posinf, f.neginf, f.zeros, f.numel) == (1, 1, 1, 1, 7)
    assert f.over_fp16 == 1 and f.over_bf16 == 0
    assert f.subnormal == 1
    assert f.min_nonzero_abs is not None and f.min_nonzero_abs < 1e-44


def test_batched_path_stacks_chunks_and_keeps_slots_apart() -> None:
    # results kept on the device, stacked every CHUNK, read once
    p = PendingStats()
    n = PendingStats.CHUNK * 2 + 7
    for i in range(n):
        dtype = torch.float16 if i % 3 else torch.float32
        p.add(i, torch.tensor([float(-i), float(i) + 0.5], dtype=dtype))
    assert len(p) == n
    v = p.read()
    assert len(p) == 0
    assert all(v[i] == (float(-i), float(i) + 0.5) for i in range(n) if i % 3 == 0)
    assert all(v[i] == (float(torch.tensor(-i, dtype=torch.float16)), float(torch.tensor(i + 0.5, dtype=torch.float16)))
               for i in range(n) if i % 3)
