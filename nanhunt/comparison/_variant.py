"""The runs a comparison compares against float32: autocast dtypes, and a model's torchao float8 layers in float8.

A model converted with torchao's ``convert_to_float8_training`` holds ``Float8Linear`` layers whose matmuls cast
their operands to float8 whatever autocast says. Its float32 reference, and each autocast run, take those layers
out of float8: they run as the ``nn.Linear`` a ``module_filter_fn`` leaving them out would have kept, on the same
weights (the bisection's mechanism, :func:`nanhunt.step._float8.out_of_float8`, undone after each run). The
``float8`` run leaves them in float8, as the step ran, under the step's autocast dtype if it had one. So a float8
model's comparison has three columns: float32, bfloat16 and float8, from the same state and RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._util._errors import InputError
from .._util._text import dtype_name
from ..step._float8 import float8_layers, out_of_float8
from ._defaults import _as_dtype, default_tolerances

__all__ = ["FLOAT8", "Variant", "variants", "float8_label", "float8_note", "running", "default_names", "asked",
           "float8_autocast"]

FLOAT8 = "float8"
# e4m3's spacing at 1 is 2**-3: as float16's and bfloat16's defaults, about one unit in the last place
_FLOAT8_RTOL, _FLOAT8_ATOL = 0.125, 1e-5
_SHOWN = 4  # layers a variant's name lists; the note lists them all


@dataclass(frozen=True)
class Variant:
    """One run compared against the float32 reference: ``name`` as ``Comparison.dtype`` holds it (``float16``,
    ``bfloat16``, ``float8``); ``autocast`` its autocast dtype (None: autocast off); ``float8`` whether the model's
    float8 layers stay in float8; ``label`` its name in the report when it is not plain autocast."""

    name: str
    autocast: torch.dtype | None
    float8: bool = False
    label: str = ""

    def run_name(self) -> str:
        return self.label or f"autocast {self.name}"

    def tolerances(self) -> tuple[float, float]:
        """``(rtol, atol)`` when the rule gives none."""
        if self.float8:
            return _FLOAT8_RTOL, _FLOAT8_ATOL
        assert self.autocast is not None
        return default_tolerances(self.autocast)

    def limit(self) -> float:
        """The largest finite value the run's values between modules can hold (a float8 cast scales its operand
        into e4m3's range; what leaves the layer is in the autocast dtype, or float32)."""
        return float(torch.finfo(self.autocast or torch.float32).max)


def _names(text: str | torch.dtype | Sequence[torch.dtype | str]) -> list[str]:
    items: list[torch.dtype | str]
    if isinstance(text, str):
        items = [d.strip() for d in text.split(",")]
    elif isinstance(text, torch.dtype):
        items = [text]
    else:
        items = list(text)
    names = [FLOAT8 if isinstance(d, str) and d.strip().lower() == FLOAT8 else dtype_name(_as_dtype(d))
             for d in items]
    if not names or len(set(names)) != len(names):
        raise InputError(f"compare needs one or more different runs (float16, bfloat16, float8), not {text}")
    return names


def default_names(model: nn.Module, autocast: torch.dtype | None) -> list[str]:
    """What is compared when nothing is asked: a float8 model's float8 layers as they ran and bfloat16; else the
    step's autocast dtype (float16 for a step without one)."""
    if float8_layers(model):
        return [FLOAT8, "bfloat16"]
    return [dtype_name(autocast) if autocast in (torch.float16, torch.bfloat16) else "float16"]


def float8_autocast(step_dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype a float8 run takes from the step's: float16 or bfloat16, else None (autocast off)."""
    return step_dtype if step_dtype in (torch.float16, torch.bfloat16) else None


def asked(names: Sequence[str] | None, model: nn.Module, step_dtype: torch.dtype) -> list[str]:
    """``nanhunt compare``'s runs: those ``--dtype`` names, checked against the model (``float8`` needs float8
    layers: refused before anything runs), or :func:`default_names` for the step's autocast dtype."""
    if names is None:
        return default_names(model, float8_autocast(step_dtype))
    variants(names, model)
    return list(names)


def variants(dtype: str | torch.dtype | Sequence[torch.dtype | str] | None, model: nn.Module, *,
             float8_autocast: torch.dtype | str | None = None) -> list[Variant]:
    """The runs ``dtype`` asks for (None: :func:`default_names`). ``float8`` needs float8 layers in the model."""
    layers = float8_layers(model)
    fa = None if float8_autocast is None else _as_dtype(float8_autocast)
    names = default_names(model, fa) if dtype is None else _names(dtype)
    out: list[Variant] = []
    for n in names:
        if n == FLOAT8:
            if not layers:
                raise InputError("float8 compares a model's torchao float8 layers (Float8Linear, from "
                                 "convert_to_float8_training) in float8, and this model holds none: compare it "
                                 "under float16 or bfloat16")
            out.append(Variant(FLOAT8, fa, True, float8_label(layers, fa)))
        else:
            out.append(Variant(n, _as_dtype(n)))
    return out


def _recipe(layer: nn.Module) -> str:
    """torchao's recipe name the layer's config is (its ``emulate`` aside), else ``custom``."""
    config: Any = getattr(layer, "config", None)
    mod = sys.modules.get("torchao.float8.config")  # loaded: the model holds float8 layers
    recipes = getattr(mod, "Float8LinearRecipeName", None)
    make = getattr(getattr(mod, "Float8LinearConfig", None), "from_recipe_name", None)
    if config is None or recipes is None or make is None:
        return "custom"
    for r in recipes:
        try:
            if dataclasses.replace(make(r), emulate=config.emulate) == config:
                return str(r.value)
        except (TypeError, ValueError, AttributeError):  # a torchao whose recipes or configs differ
            continue
    return "custom"


def float8_label(layers: Mapping[str, nn.Module], autocast: torch.dtype | None) -> str:
    """``float8 (tensorwise) on proj, text_proj``: the recipe and the layers (several recipes: each with its own),
    and the autocast dtype around them, if any."""
    by: dict[str, list[str]] = {}
    for name, layer in layers.items():
        by.setdefault(_recipe(layer), []).append(name or "<root>")

    def names(ns: list[str]) -> str:
        if len(ns) <= _SHOWN:
            return ", ".join(ns)
        return f"{len(ns)} layers ({', '.join(ns[:_SHOWN - 1])}, ...)"

    if len(by) == 1:
        (recipe, ns), = by.items()
        text = f"float8 ({recipe}) on {names(ns)}"
    else:
        text = "float8 (" + "; ".join(f"{r} on {names(ns)}" for r, ns in by.items()) + ")"
    return text + (f", under autocast {dtype_name(autocast)}" if autocast is not None else "")


def float8_note(layers: Mapping[str, nn.Module], vs: Sequence[Variant]) -> str | None:
    """What a float8 model's runs did with its float8 layers (None: it holds none)."""
    if not layers:
        return None
    names = ", ".join(n or "<root>" for n in layers)
    others = ["the float32 reference"] + [v.run_name() for v in vs if not v.float8]
    text = (f"float8 layers {names}: run as nn.Linear on the same weights (out of float8) in "
            f"{' and '.join(others)}")
    if any(v.float8 for v in vs):
        text += ", and in float8, as the model holds them, in the float8 run"
    return text + "; errors are measured per row (each vector along the last dimension): tensorwise scaling can " \
                  "send every row but the largest to zero"


@contextlib.contextmanager
def running(layers: Mapping[str, nn.Module], variant: Variant | None) -> Iterator[None]:
    """The model's float8 layers as ``variant`` runs them (None: the float32 reference) until the block exits:
    taken out of float8 unless the variant keeps them, put back exactly after, also on an exception."""
    if not layers or (variant is not None and variant.float8):
        yield
        return
    undo = out_of_float8(layers, out=tuple(layers))
    try:
        yield
    finally:
        undo()
