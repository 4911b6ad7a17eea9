"""Callbacks that give a framework's training run what :class:`nanhunt.Guard` gives a hand-written loop.

``nanhunt.integrations.transformers.NanhuntCallback`` (a ``transformers.TrainerCallback``) and
``nanhunt.integrations.lightning.NanhuntCallback`` (a Lightning ``Callback``). Each lives in its own module and
imports its framework there: importing ``nanhunt`` or this package imports neither.
"""

__all__: list[str] = []
