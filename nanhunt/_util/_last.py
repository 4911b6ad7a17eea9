"""Where the last ``trace(stop_at_first=True)`` stopped: read as ``nanhunt.last`` (the package's ``__getattr__``
reads :data:`stop` here, so the tracer sets it without importing the package above it)."""

from __future__ import annotations

from ._errors import Stop

stop: Stop | None = None
