"""A checkpoint's state dict onto the model's names (DDP and torch.compile prefixes), and dtype names."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .._util._errors import InputError
from .._util._text import dtype_name, few, shown


_PREFIXES = ("module", "_orig_mod")  # DDP, torch.compile


# ------------------------------------------------------------------ loading
def map_state_dict(sd: Mapping[str, Any], model: nn.Module, *,
                   notes: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Map DDP (``module.``), torch.compile (``_orig_mod.``) and wrapper prefixes (Lightning's ``model.``)
    to the model's keys, and check every key and shape; one error listing the first mismatches.

    A key keeps its name when the model has it (``AveragedModel``'s own ``module.*``); otherwise the
    shortest prefix whose removal makes it a model key is removed. Keys of something beside the model
    (a loss's ``criterion.pos_weight``) are ignored with a line in ``notes``."""
    want = model.state_dict()
    heads = {k.split(".", 1)[0] for k in want}
    depth = max((k.count(".") + 1 for k in want), default=0)
    # each checkpoint key -> (components stripped, its wrapper head or None, the model key it fits)
    fits: dict[str, tuple[int, str | None, str]] = {}
    unmatched: list[str] = []
    for k, v in sd.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            continue
        found = next(((i, head, cand) for i, head, cand in _candidates(k, depth) if cand in want), None)
        if found is None:
            unmatched.append(k)
        else:
            fits[k] = found
    # one wrapper head for most keys ('model.') wins over a stray one ('criterion.') fitting the same key
    popular: dict[str | None, int] = {}
    for _, head, _ in fits.values():
        popular[head] = popular.get(head, 0) + 1
    source: dict[str, str] = {}
    ambiguous: list[str] = []
    for k, (i, head, target) in fits.items():
        other = source.get(target)
        if other is None:
            source[target] = k
            continue
        j, other_head, _ = fits[other]
        mine, theirs = (-i, popular[head]), (-j, popular[other_head])
        if mine == theirs:
            ambiguous.append(f"{shown(other)} and {shown(k)} (both {shown(target)})")
        elif mine > theirs:
            source[target] = k
    if ambiguous:
        raise InputError(f"checkpoint keys fit the model in more than one way: {few(ambiguous)}; "
                           "save the model's own state_dict (model.state_dict())")
    out = {target: sd[k] for target, k in source.items()}
    duplicates = [k for k in fits if source[fits[k][2]] != k]
    # a key naming none of the model's top-level entries, under any wrapper, belongs to something else
    foreign = [k for k in unmatched if not _under(k, heads)]
    missing = [k for k in want if k not in out]
    shapes = [f"{shown(k)} {tuple(out[k].shape)} vs {tuple(want[k].shape)}"
              for k in want if k in out and tuple(out[k].shape) != tuple(want[k].shape)]
    # only a complete load ignores them: beside a missing key, an extra one is likely that key renamed
    unexpected = unmatched if missing or shapes else [k for k in unmatched if k not in foreign]
    if not (missing or shapes) and (foreign or duplicates) and notes is not None:
        notes.append(f"checkpoint entries that are not the model's were ignored: {_few(foreign + duplicates)}")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch {few(shapes)}")
        raise InputError("checkpoint keys don't match the model: " + "; ".join(parts)
                           + " — is --model the factory that built this checkpoint?")
    return out


def _few(keys: list[str]) -> str:
    """The first keys of a checkpoint's or the model's, each as a message quotes a name from a file: escaped,
    and cut past ``NAME_SHOWN`` characters with its length said (a file may name an entry with megabytes)."""
    return few(keys, show=shown)


def _starts(parts: list[str]) -> Iterator[tuple[int, str | None]]:
    """Where a key's shorter forms start (its ``parts`` split at dots), with the wrapper component stripped
    before that start (None: none): any number of DDP/compile prefixes and at most one other wrapper component.
    Linear in the parts: a file's key may hold millions of them."""
    wrapper: str | None = None
    for i, p in enumerate(parts):
        yield i, wrapper
        if p not in _PREFIXES:
            if wrapper is not None:
                return
            wrapper = p


def _under(key: str, heads: set[str]) -> bool:
    """Whether one of ``key``'s shorter forms starts with one of ``heads`` (the model's top-level entries)."""
    parts = key.split(".")
    return any(parts[i] in heads for i, _ in _starts(parts))


def _candidates(key: str, depth: int) -> list[tuple[int, str | None, str]]:
    """``key``'s shorter forms (:func:`_starts`) of at most ``depth`` components (a longer one is no model key),
    fewest components stripped first, as (components stripped, its wrapper head or None, the form)."""
    parts = key.split(".")
    return [(i, head, ".".join(parts[i:])) for i, head in _starts(parts) if len(parts) - i <= depth]


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[dtype_name(name)]
    except KeyError:
        raise InputError(f"unknown dtype {name!r}; use float16, bfloat16 or float32") from None
