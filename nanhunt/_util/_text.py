"""Small pieces of text every layer writes alike: a few names of a longer list, a name from a file escaped and
bounded, a dtype's name. No torch: a dtype is named by its ``str``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["few", "escaped", "cut", "shown", "NAME_SHOWN", "dtype_name"]

# The characters of one name a message or a report shows: a file may name an entry with megabytes (a 5 MB key
# printed whole is megabytes on the terminal), and no real module path, op or key comes near it.
NAME_SHOWN = 200


def few(items: Sequence[str], n: int = 3, *, show: Callable[[str], str] = str) -> str:
    """The first ``n`` of ``items``, each as ``show`` writes it, then how many more: ``a, b, c (+2 more)``."""
    return ", ".join(show(i) for i in items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def escaped(text: str) -> str:
    """``text`` in ASCII, every control and non-ASCII character escaped (``\\n``, ``\\x1b``, ``\\u202e``): a name
    read from a file, quoted in a message."""
    return text.encode("unicode_escape").decode("ascii")


def cut(text: str, limit: int = NAME_SHOWN) -> str:
    """``text`` whole when it has at most ``limit`` characters; else its first ``limit`` and its length:
    ``aaaa... (5,000,010 characters)``. Not escaped: each format escapes the result its own way."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def shown(name: str, limit: int = NAME_SHOWN) -> str:
    """A name read from a file as a message quotes it: cut (:func:`cut`), then escaped (:func:`escaped`), so it
    is one line of ASCII at most ten times ``limit`` long whatever the file holds."""
    return escaped(cut(name, limit))


def dtype_name(dtype: object) -> str:
    """``float16`` for ``torch.float16`` (or for the text ``"torch.float16"``)."""
    return str(dtype).replace("torch.", "")
