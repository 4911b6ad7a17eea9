"""The text every layer writes alike (nanhunt._util._text): a few names of a list, a name from a file, a dtype."""

from __future__ import annotations

import torch

from nanhunt._util._text import dtype_name, escaped, few


def test_few_names_the_first_three_and_counts_the_rest() -> None:
    assert few([]) == ""
    assert few(["a", "b", "c"]) == "a, b, c"
    assert few(["a", "b", "c", "d", "e"]) == "a, b, c (+2 more)"
    assert few(["a", "b", "c"], 1) == "a (+2 more)"


def test_few_writes_each_name_as_asked() -> None:
    # a name read from a file: its control characters escaped, so it cannot end or forge a line
    assert few(["ok", "bad\n\x1b[31m", "\u202eevil"], show=escaped) == "ok, bad\\n\\x1b[31m, \\u202eevil"


def test_dtype_name() -> None:
    assert dtype_name(torch.float16) == "float16"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("torch.float32") == "float32"
    assert dtype_name("float32") == "float32"
