"""A Guard attribute kept by one of its parts (``guard.dump_dir`` is its capture writer's): one place holds each
setting, and the Guard's public names read and write it there."""

from __future__ import annotations

from typing import Generic, TypeVar, overload

__all__ = ["Part"]

_T = TypeVar("_T")


class Part(Generic[_T]):
    """A Guard attribute kept by one of its parts, read and written through (``guard.dump_dir``)."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part, self.name = part, name or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Part[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Part[_T] | _T:
        if obj is None:
            return self
        value: _T = getattr(getattr(obj, self.part), self.name)
        return value

    def __set__(self, obj: object, value: _T) -> None:
        setattr(getattr(obj, self.part), self.name, value)
