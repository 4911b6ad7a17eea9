"""What a Trainer checkpoint's ``training_args.bin`` says, read without running it.

The file is ``torch.save(TrainingArguments)``: a pickle of the transformers class, which only a full unpickle
(imports and constructors named by the file: code) would rebuild. It is the one file of a checkpoint that says
which precision the run used (``fp16``, ``bf16``) and how it was optimised (``learning_rate``, ``warmup_steps``,
``max_grad_norm``...). Here it is unpickled with every global the file names replaced by an inert stand-in that
only remembers its arguments and state: nothing is imported, no constructor of the file's choosing runs, and
the file was bounded (zip directory, CRCs, the pickle's depth and length) by the same checks as every torch file
before the unpickler sees it. Only plain values (booleans, numbers, short strings) are read back.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from typing import Any

from .._util._errors import InputError
from .._util._files import check_readable
from .._util._safeload import check_bytes
from .._util._text import escaped

__all__ = ["read_training_args", "TRAINING_ARGS"]

TRAINING_ARGS = "training_args.bin"
_MAX_BYTES = 1 << 20  # a TrainingArguments pickle is some 4 kB; a MiB is far beyond any real one
# the fields read back, each with the type it must have: what precision the run used and how it optimised
_FIELDS: dict[str, type] = {
    "fp16": bool, "bf16": bool, "use_cpu": bool, "no_cuda": bool, "learning_rate": float, "weight_decay": float,
    "adam_beta1": float, "adam_beta2": float, "adam_epsilon": float, "max_grad_norm": float, "warmup_steps": int,
    "warmup_ratio": float, "lr_scheduler_type": str, "optim": str, "gradient_accumulation_steps": int,
    "per_device_train_batch_size": int, "seed": int, "half_precision_backend": str}
_TEXT = 64  # characters of a string field kept (an enum's value: "linear", "adamw_torch")


class _Inert:
    """What every global of the file becomes: it takes any arguments and state and does nothing with them."""

    _name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        self = super().__new__(cls)
        self.__dict__["_args"] = args
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _InertUnpickler(pickle.Unpickler):
    _MAX_GLOBALS = 256  # a TrainingArguments pickle names about ten

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._made: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key not in self._made:
            if len(self._made) >= self._MAX_GLOBALS:
                raise pickle.UnpicklingError(f"it names more than {self._MAX_GLOBALS} globals")
            self._made[key] = type("_Inert", (_Inert,), {"_name": key})
        return self._made[key]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds tensor storages, which TrainingArguments does not")


def _plain(v: Any, kind: type) -> Any:
    """A field's value as plain data of its type, or None: an enum member (an inert stand-in built from its
    value) gives that value where the field is text."""
    if isinstance(v, _Inert) and kind is str:
        args = v.__dict__.get("_args", ())
        v = args[0] if len(args) == 1 else None
    if kind is bool:
        return v if isinstance(v, bool) else None
    if isinstance(v, bool):
        return None
    if kind is int:
        return v if isinstance(v, int) and abs(v) < 1 << 63 else None
    if kind is float:
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
    return escaped(v[:_TEXT]) if isinstance(v, str) else None


def read_training_args(path: str, where: str) -> dict[str, Any] | None:
    """The plain fields of ``TrainingArguments`` saved at ``path`` (see the module docstring), or None when the
    file holds no TrainingArguments; :class:`InputError` for a file that is no torch file or is beyond bounds."""
    name = f"{where}: its {TRAINING_ARGS}"
    size = check_readable(path, name)
    if size > _MAX_BYTES:
        raise InputError(f"{name} is {size} bytes, more than any TrainingArguments ({_MAX_BYTES} at most); "
                         "pass --dtype to say which precision the run used")
    with open(path, "rb") as f:
        data = f.read(_MAX_BYTES + 1)
    check_bytes(data, name=name)  # the zip directory, CRCs, and the pickle's depth and length
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            member = next((i for i in z.infolist() if i.filename.endswith("data.pkl")), None)
            if member is None:
                return None
            obj = _InertUnpickler(io.BytesIO(z.read(member))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as e:
        raise InputError(f"{name} could not be read ({type(e).__name__}); pass --dtype to say which precision "
                         "the run used") from e
    if not isinstance(obj, _Inert) or not obj._name.endswith("TrainingArguments"):
        return None
    state = obj.__dict__.get("_state")
    if isinstance(state, tuple) and state and isinstance(state[0], dict):  # (dict, slots)
        state = state[0]
    if not isinstance(state, dict):
        return None
    read = {k: _plain(state.get(k), kind) for k, kind in _FIELDS.items()}
    return {k: v for k, v in read.items() if v is not None}
