"""Which rank went first: under ``torch.distributed``, each rank's leading origin is gathered once at
the end of a trace (one ``all_gather_object`` of a few plain values) and compared by step order
(phase, then the op's position in the step), on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .._util._dispatch import collective_label
from ..records import Occurrence, Phase, Record

__all__ = ["RankView", "gather_ranks", "available", "received_through"]

_PHASES = list(Phase)
# (phase position, record index, description) of a rank's first origin, or None; then what it received
Entry = tuple[tuple[int, int, str] | None, str | None]


@dataclass(frozen=True)
class RankView:
    """Every rank's answer to "where did NaN/Inf start", as this rank heard it."""

    rank: int  # this rank
    ranks: dict[int, str | None]  # rank -> its first origin, described; None when it made none
    first_ranks: tuple[int, ...]  # the ranks whose origin came first (several on a tie); () when none
    received: dict[int, str | None]  # rank -> the collective its first non-finite value arrived through

    @property
    def first_rank(self) -> int | None:
        return self.first_ranks[0] if self.first_ranks else None

    def summary(self) -> str | None:
        """``rank 1: Inf born in ...; rank 0 received it through the gradient all-reduce``."""
        if not self.first_ranks:
            return None
        head = "; ".join(f"rank {r}: {self.ranks[r]}" for r in self.first_ranks)
        others = [r for r in sorted(self.ranks) if r not in self.first_ranks]
        got = [r for r in others if self.received.get(r)]
        parts = [head]
        by_what: dict[str, list[int]] = {}
        for r in got:
            by_what.setdefault(str(self.received[r]), []).append(r)
        for what, rs in by_what.items():
            parts.append(f"{_ranks(rs)} received it through the {what}")
        own = [r for r in others if r not in got and self.ranks[r] is not None]
        parts.extend(f"rank {r}: {self.ranks[r]} (later)" for r in own)
        return "; ".join(parts)


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def available() -> bool:
    return dist.is_available() and dist.is_initialized()


def received_through(r: Record) -> str:
    """``the gradient all-reduce``: what a received record arrived through, in words."""
    what = (collective_label(r.op) or r.op) if r.op is not None else "collective"
    return f"gradient {what}" if r.phase in (Phase.BACKWARD, Phase.UPDATE) else what


def gather_ranks(first: Occurrence | None, received: Record | None) -> RankView:
    """Gather every rank's leading origin (a collective: every rank must call it) and compare."""
    mine: Entry = (None if first is None else (_PHASES.index(first.phase), first.output.index, first.describe()),
                   None if received is None else received_through(received))
    world = dist.get_world_size()
    got: list[Entry | None] = [None] * world
    dist.all_gather_object(got, mine)
    ranks: dict[int, str | None] = {}
    recv: dict[int, str | None] = {}
    keys: dict[int, tuple[int, int]] = {}
    for r, e in enumerate(got):
        origin, through = e if e is not None else (None, None)
        ranks[r] = None if origin is None else origin[2]
        recv[r] = through
        if origin is not None:
            keys[r] = (origin[0], origin[1])
    best = min(keys.values()) if keys else None
    first_ranks = tuple(r for r in sorted(keys) if keys[r] == best)
    return RankView(rank=dist.get_rank(), ranks=ranks, first_ranks=first_ranks, received=recv)
