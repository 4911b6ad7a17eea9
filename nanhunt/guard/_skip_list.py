"""The batches a rollback skipped, in ``skip_batches.json``: plain Python (no torch).

The file is rewritten whole at every rollback, through a new file renamed onto its name (``_util._files``), so a
reader (or a run killed mid-write) never sees half a list: it is valid JSON at all times, and says what it is. A
link or a FIFO planted at its name is refused, never written through nor waited on.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .._util._files import write_file

__all__ = ["SkipList", "WHAT"]

WHAT = ("The batches nanhunt.Guard skipped: one entry per rollback. The loop did not train on the batch of "
        "'step' (its detection, 'kind' and 'detail', and the Guard's event file 'event' in this directory, if one "
        "was written), nor kept the updates of the steps from 'restored_step' on (with snapshot_every > 1 the "
        "steps since the snapshot are undone too). 'batches' lists each of those steps with the dataset indices of "
        "its batch, as the loop gave them to guard.step(batch, indices=...); null where it gave none "
        "('indices_note' says why). To leave these samples out of a re-run, drop every index listed here from the "
        "dataset (torch.utils.data.Subset over the others).")


class SkipList:
    """``dump_dir/skip_batches[-rank{R}].json``: the entries of this Guard's rollbacks, written whole each time."""

    def __init__(self, rank: int | None) -> None:
        self.rank = rank
        self.entries: list[dict[str, Any]] = []

    def path(self, dump_dir: str) -> str:
        return os.path.join(dump_dir, "skip_batches" + (f"-rank{self.rank}" if self.rank is not None else "") + ".json")

    def add(self, dump_dir: str, entry: dict[str, Any]) -> str:
        """Add one rollback's entry and rewrite the file in ``dump_dir``; returns its path. Raises OSError when it
        cannot be written, a link or a FIFO at its name refused (the entry is kept: the next rollback writes it)."""
        self.entries.append(entry)
        os.makedirs(dump_dir, exist_ok=True)
        path = self.path(dump_dir)
        write_file(path, _text(self.rank, self.entries))  # the old list or the new one, never a mix
        return path


def _text(rank: int | None, entries: list[dict[str, Any]]) -> str:
    """The file's JSON, one entry a line (a batch's indices stay on its line)."""
    skipped = ",\n".join(f"  {json.dumps(e)}" for e in entries)
    return (f'{{\n "what": {json.dumps(WHAT)},\n "rank": {json.dumps(rank)},\n "skipped": [\n{skipped}\n ]\n}}\n')
