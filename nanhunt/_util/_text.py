"""Small pieces of text every layer writes alike: a few names of a longer list, a name from a file escaped, a
dtype's name. No torch: a dtype is named by its ``str``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["few", "escaped", "dtype_name"]


def few(items: Sequence[str], n: int = 3, *, show: Callable[[str], str] = str) -> str:
    """The first ``n`` of ``items``, each as ``show`` writes it, then how many more: ``a, b, c (+2 more)``."""
    return ", ".join(show(i) for i in items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def escaped(text: str) -> str:
    """``text`` in ASCII, every control and non-ASCII character escaped (``\\n``, ``\\x1b``, ``\\u202e``): a name
    read from a file, quoted in a message."""
    return text.encode("unicode_escape").decode("ascii")


def dtype_name(dtype: object) -> str:
    """``float16`` for ``torch.float16`` (or for the text ``"torch.float16"``)."""
    return str(dtype).replace("torch.", "")
