#!/usr/bin/env python3
"""What nanhunt's checked loading costs over a bare ``torch.load``, on a ~1 GB checkpoint.

    ./.venv/bin/python scripts/bench_load.py              # 1 GiB in 64 tensors, 3 repetitions
    ./.venv/bin/python scripts/bench_load.py --mib 256 --reps 5

``nanhunt.capture.capture.load_file`` checks every zip member's CRC-32 before torch reads the file (torch does
not, so a flipped bit loads as different numbers), then walks what was loaded. Both loads read the
same file from the page cache (it is read once first), so the ratio is the CPU cost of the checks,
not the disk's. Timings are medians over interleaved repetitions. The file is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanhunt._util._safeload import _check_format  # noqa: E402
from nanhunt.capture.capture import load_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    ap.add_argument("--tensors", type=int, default=64, help="number of tensors it is split into (default 64)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    per = args.mib * (1 << 20) // 4 // args.tensors
    sd = {f"layer{i}.weight": torch.randn(per) for i in range(args.tensors)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        torch.save(sd, path)
        del sd
        size = os.path.getsize(path)
        with open(path, "rb") as f:  # into the page cache
            while f.read(64 << 20):
                pass
        bare: list[float] = []
        checked: list[float] = []
        crc: list[float] = []
        for _ in range(args.reps):
            t = time.perf_counter()
            torch.load(path, map_location="cpu", weights_only=True)
            bare.append(time.perf_counter() - t)
            t = time.perf_counter()
            load_file(path, what="checkpoint")
            checked.append(time.perf_counter() - t)
            t = time.perf_counter()
            _check_format(path, "checkpoint", size)
            crc.append(time.perf_counter() - t)
    b, c, k = statistics.median(bare), statistics.median(checked), statistics.median(crc)
    print(f"file: {size / 2**30:.2f} GiB, {args.tensors} tensors, median of {args.reps}")
    print(f"torch.load alone:              {b:.3f} s")
    print(f"nanhunt load_file (with CRC):  {c:.3f} s")
    print(f"  of which the CRC pass:       {k:.3f} s ({size / k / 2**30:.2f} GiB/s)")
    print(f"ratio load_file / torch.load:  {c / b:.2f}")


if __name__ == "__main__":
    main()
