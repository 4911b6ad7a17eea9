"""Private: a JSON file or text that may be damaged or hostile (a report, an acceptance rule, a manifest, a
safetensors header), read bounded in size and depth, with one error line per failure."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from ._errors import InputError, first_line as _first_line

__all__ = ["read_json", "parse_json", "MAX_JSON_BYTES", "MAX_JSON_DEPTH"]

# A JSON file nanhunt reads is a report or an acceptance rule: tens of kB (a report with its timeline is some
# 20 kB). Parsed, JSON takes up to ~27 bytes a byte ('[[],[],...]': a list object each 3 bytes), so 16 MiB
# of it stays under half a GiB; a 99 MB report took 2.45 GB.
MAX_JSON_BYTES = 16 << 20
MAX_JSON_DEPTH = 64  # a report nests 6 levels; json itself raises RecursionError near 1000


def read_json(path: str, *, what: str, fix: str, label: str | None = None, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in ``path``, read bounded (:func:`parse_json`); :class:`InputError` otherwise, one line:
    ``{label} is not {what} (...); {fix}`` (``label`` defaults to the quoted path)."""
    label = label or repr(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size  # a regular file's: refused unread; a pipe's is 0, read past the cap
            data = f.read(max_bytes + 1) if size <= max_bytes else b""
    except OSError as e:
        raise InputError(f"cannot read {label}: {e.strerror or e}") from e
    try:
        if size > max_bytes:
            raise _too_big(size, what, max_bytes)
        return parse_json(data, what=what, max_bytes=max_bytes)
    except ValueError as e:
        raise InputError(f"{label} {e}; {fix}") from e


def parse_json(data: str | bytes, *, what: str = "JSON", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """JSON text (or its UTF-8 bytes) parsed, at most ``max_bytes`` long and nested at most ``MAX_JSON_DEPTH``
    deep; ValueError says why not, in words that follow a file's name ("is not JSON (...)")."""
    if len(data) > max_bytes:
        raise _too_big(len(data), what, max_bytes)
    try:
        value = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except UnicodeDecodeError as e:
        raise ValueError(f"is not {what}: it is not UTF-8 text") from e
    except RecursionError as e:
        raise ValueError(f"is not {what}: it nests more than {MAX_JSON_DEPTH} levels deep") from e
    except ValueError as e:
        raise ValueError(f"is not {what} ({_first_line(e)})") from e
    _check_json_depth(value, what)
    return value


def _too_big(size: int, what: str, max_bytes: int) -> ValueError:
    return ValueError(f"holds {size / 2**20:,.1f} MiB, more than nanhunt reads of {what} ({max_bytes / 2**20:g} MiB)")


def _check_json_depth(value: Any, what: str) -> None:
    """Walked depth first, one open container a level (as :func:`_check_loaded`)."""
    levels: list[Iterator[Any]] = []
    if isinstance(value, (dict, list)):
        levels.append(iter(value.values() if isinstance(value, dict) else value))
    while levels:
        for v in levels[-1]:
            if isinstance(v, (dict, list)):
                if len(levels) >= MAX_JSON_DEPTH:
                    raise ValueError(f"is not {what}: it nests more than {MAX_JSON_DEPTH} levels deep")
                levels.append(iter(v.values() if isinstance(v, dict) else v))
                break
        else:
            levels.pop()
