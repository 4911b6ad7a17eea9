"""The Guard's event written beside a capture (``step{N}[-rank{R}]-event.json`` next to ``-checkpoint.pt``, a
capture directory's ``event-rank{R}.json``), read with the capture: the file came with it, so it is untrusted."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ..records import GuardEvent, HeadroomHistory

__all__ = ["EventFile", "read_event"]


@dataclass(frozen=True)
class EventFile:
    """What the Guard's event file of a capture gave: the event and the headroom history written with it, each None
    when absent or unusable, and a note when one was there but could not be used."""

    event: GuardEvent | None = None
    headroom: HeadroomHistory | None = None
    note: str | None = None


_EVENT_BYTES = 64 * 1024  # a Guard's event is about 1 kB; its scale history at most 50 pairs
_EVENT_TEXT = 500  # characters kept of its kind and detail


def read_event(path: str) -> EventFile | None:
    """The Guard's event at ``path``, None when there is none (not a Guard's capture). Untrusted: bounded in size,
    a regular file, every field used type-checked (text is escaped where it is shown)."""
    try:
        st = os.lstat(path)  # a symbolic link is no file the Guard wrote: it could point at any file of the machine
    except OSError:
        return None
    refused = f"the Guard event {path!r} beside the checkpoint was ignored"
    if not stat.S_ISREG(st.st_mode):
        return EventFile(note=f"{refused}: it is not a regular file")
    if st.st_size > _EVENT_BYTES:
        return EventFile(note=f"{refused}: {st.st_size} bytes, more than a Guard writes ({_EVENT_BYTES})")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_EVENT_BYTES + 1).decode("utf-8"))
        event = _event_of(data)
    except OSError as e:
        return EventFile(note=f"{refused}: {e.strerror}")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return EventFile(note=f"{refused}: {_why(e)}")
    raw = data.get("headroom")
    if raw is None:  # an older Guard's, or nothing was sampled
        return EventFile(event)
    try:
        if not isinstance(raw, dict):
            raise ValueError(f"it holds a JSON {type(raw).__name__}, not an object")
        return EventFile(event, HeadroomHistory.from_dict(raw))
    except (KeyError, TypeError, ValueError) as e:  # the event stands without it
        return EventFile(event, note=f"the headroom history in the Guard event {path!r} was ignored: {_why(e)}")


def _why(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _event_of(d: Any) -> GuardEvent:
    """A :class:`GuardEvent` of the fields nanhunt shows, each checked; ``ValueError`` names the first bad one."""
    if not isinstance(d, dict):
        raise ValueError(f"it holds a JSON {type(d).__name__}, not an object")

    def count(key: str, *, optional: bool = False) -> Any:
        v = d.get(key)
        if v is None and (optional or key not in d):
            return None if optional else 0
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2 ** 63:
            raise ValueError(f"its {key!r} is not a non-negative integer")
        return v

    def text(key: str) -> str:
        v = d.get(key)
        if not isinstance(v, str):
            raise ValueError(f"its {key!r} is not a string")
        return v if len(v) <= _EVENT_TEXT else v[:_EVENT_TEXT] + "..."

    if "step" not in d:
        raise ValueError("it has no 'step'")
    ranks = d.get("ranks", [])
    if not isinstance(ranks, list) or len(ranks) > 4096 or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 2 ** 31 for r in ranks):
        raise ValueError("its 'ranks' is not a list of ranks")
    scale = d.get("scale")
    if isinstance(scale, str) and scale in ("inf", "-inf", "nan"):
        scale = float(scale)  # JSON has no Inf: nanhunt writes it as a string
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError("its 'scale' is not a number")
    pre_update = d.get("pre_update", False)
    if not isinstance(pre_update, bool):
        raise ValueError("its 'pre_update' is not true or false")
    return GuardEvent(step=count("step"), kind=text("kind"), detail=text("detail"), rank=count("rank", optional=True),
                      ranks=tuple(ranks), captured_step=count("captured_step", optional=True), pre_update=pre_update,
                      iterations=count("iterations"), updates=count("updates"), skipped=count("skipped"),
                      scale=None if scale is None else float(scale))
