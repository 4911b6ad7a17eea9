"""A seeded corpus of hostile captures, run the way a user runs nanhunt on a file attached to a ticket.

Every kind the security campaign found (names of code, small files that grow or recurse, links out of a capture
directory, a bundle directory of the user's own files) is drawn with sizes and variants from a seed
(``NANHUNT_CORPUS_SEED``, default 0; the seed is in every failure message) and run in one fresh process
(tests/security/corpus_driver.py). For every case: exit 2 and one line, no traceback; no payload ran, nothing of a
named library was imported, no connection was tried; no file outside the output folder was written or removed; and
the whole run peaked under 1 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("corpus_driver.py")
SEED = int(os.environ.get("NANHUNT_CORPUS_SEED", "0"))
GIB = 1 << 30

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("corpus")
    env = {k: v for k, v in os.environ.items() if k != "NANHUNT_TRUST_NAMES"}
    done = subprocess.run([sys.executable, str(DRIVER), str(work), str(SEED)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    running = work / "running"
    assert done.returncode == 0, (f"seed {SEED}: the corpus process ended with {done.returncode} during "
                                  f"{running.read_text() if running.exists() else '?'}: {done.stderr[-2000:]}")
    data: dict[str, Any] = json.loads((work / "results.json").read_text())
    return data


def test_every_refusal_is_one_line_and_exit_2(corpus: dict[str, Any]) -> None:
    bad = []
    for r in corpus["results"]:
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        if r["exit"] != r["expected"] or "Traceback" in r["stderr"] or r["expected"] == 2 and len(lines) != 1:
            bad.append(f"{r['case']}: exit {r['exit']}, {len(lines)} lines: {r['stderr'][-300:]!r}")
    assert not bad, f"seed {SEED}:\n" + "\n".join(bad)


def test_nothing_a_link_points_at_is_shown(corpus: dict[str, Any]) -> None:
    shown = [r["stderr"] for r in corpus["results"]]
    shown += [p.read_text(errors="replace") for p in Path(corpus["out"]).rglob("*") if p.is_file()]
    assert not any("evil.example" in text for text in shown), f"seed {SEED}"


def test_no_payload_ran_and_nothing_named_was_imported(corpus: dict[str, Any]) -> None:
    for r in corpus["results"]:
        assert r["markers"] == [], f"seed {SEED}, {r['case']}: {r['markers']}"
        assert r["imported"] == [], f"seed {SEED}, {r['case']}: imported {r['imported']}"


def test_no_file_outside_the_output_was_written_or_removed(corpus: dict[str, Any]) -> None:
    for r in corpus["results"]:
        assert r["changed"] == [], f"seed {SEED}, {r['case']}: {r['changed']}"


def test_the_whole_corpus_peaks_under_one_gib(corpus: dict[str, Any]) -> None:
    assert corpus["peak_bytes"] < GIB, f"seed {SEED}: peak {corpus['peak_bytes'] / GIB:.2f} GiB"


def test_the_corpus_covers_every_kind(corpus: dict[str, Any]) -> None:
    kinds = {r["case"].split(" ")[0] for r in corpus["results"]}
    assert {"name", "deep", "lists", "zeros", "overlap", "big", "Linear", "capture", "bundle", "checkpoint",
            "safetensors"} <= kinds
