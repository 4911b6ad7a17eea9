"""The user guide (docs/, mkdocs.yml) and README: the site builds with no warning, and the examples run.

Each page's ```python blocks run in order in one namespace, in a temporary directory, as one script would:
the blocks are written to ``<page>.py`` there and run as its ``__main__``, so a class an example defines is
named by the script's path, as in a user's train.py. A block whose fence is preceded by ``<!-- not run -->``
is a fragment (or needs a GPU or several processes) and is skipped. Shell blocks are not run, but every
``nanhunt COMMAND`` they show must exist and take the ``--flags`` they show.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
NOT_RUN = "<!-- not run -->"
SHELL = ("console", "bash", "sh", "shell")
# pages whose examples import transformers and lightning (several seconds each on a small CPU)
SLOW = {"integrations.md", "compare.md"}


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # of the first line of code, 1-based
    code: str
    run: bool


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (fences at the start of a line)."""
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"(`{3,})\s*([\w+-]*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence.group(1):
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: a fence that is never closed"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        out.append(Block(fence.group(2), i + 2, "\n".join(lines[i + 1:end]), before != NOT_RUN))
        i = end + 1
    return out


def _marked(page: Path) -> object:
    return pytest.param(page, id=page.name, marks=[pytest.mark.slow] if page.name in SLOW else [])


@contextlib.contextmanager
def _as_main(script: Path) -> Iterator[types.ModuleType]:
    """A fresh ``__main__`` module whose file is ``script``, in place of the running one until the block exits."""
    module = types.ModuleType("__main__")
    module.__file__ = str(script)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        yield module
    finally:
        sys.modules["__main__"] = saved


@pytest.mark.parametrize("page", [_marked(p) for p in PAGES if any(b.lang == "python" and b.run for b in blocks(p))])
def test_python_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a page's runnable python blocks, written in order to one script (each at its own line of it)
    runnable = [b for b in blocks(page) if b.lang == "python" and b.run]
    script = tmp_path / f"{page.stem.replace('-', '_')}.py"
    text, where = "", []
    for b in runnable:
        where.append(text.count("\n"))
        text += b.code + "\n\n"
    script.write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    # the suite trusts its own packages (conftest); a page's reader has no such setting
    monkeypatch.delenv("NANHUNT_TRUST_NAMES", raising=False)
    # WHEN each block runs, in one namespace THEN none raises
    with _as_main(script) as main:
        for b, offset in zip(runnable, where):
            code = compile("\n" * offset + b.code, str(script), "exec")
            try:
                exec(code, main.__dict__)
            except BaseException as e:
                raise AssertionError(f"{page.name}:{b.line}: the example raised {type(e).__name__}: {e}") from e


def _commands(block: Block) -> list[str]:
    """The commands a shell block shows: with ``$`` prompts the prompted lines, else every unindented line;
    a line ending in ``\\`` or followed by indented lines continues; ``#`` comments dropped."""
    prompted = any(line.startswith("$ ") for line in block.code.splitlines())
    out: list[str] = []
    more = False
    for line in block.code.splitlines():
        if more or (not prompted and line.startswith((" ", "\t")) and out):
            out[-1] += " " + line.strip()
        elif prompted and line.startswith("$ "):
            out.append(line[2:])
        elif not prompted and line.strip():
            out.append(line)
        else:
            more = False
            continue
        more = line.rstrip().endswith("\\")
    return [c.split(" #")[0] for c in out]


def _help(command: str) -> str:
    from nanhunt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([command, "--help"])  # argparse's exit for --help becomes main's return value
    assert code == 0, f"nanhunt {command} --help exits {code}"
    return out.getvalue()


def test_shell_examples_name_real_commands_and_flags() -> None:
    # GIVEN every `nanhunt COMMAND ...` line of the shell blocks of README and the guide
    shown: dict[str, set[str]] = {}
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in SHELL:
                continue
            for cmd in _commands(b):
                m = re.search(r"(?:^|\s)(?:-m )?nanhunt (\w+)", cmd)
                if m is None:
                    continue
                rest = cmd[m.end():]
                if m.group(1) == "run":  # what follows the script (or -m MODULE) is the script's own
                    rest = re.split(r"\S+\.py\b|\s-m\s", rest)[0]
                flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest))
                shown.setdefault(m.group(1), set()).update(flags)
    assert {"replay", "inspect", "report", "compare"} <= set(shown)
    # WHEN each command's --help is read THEN it exists and takes every flag shown with it
    for command, flags in sorted(shown.items()):
        text = _help(command)
        missing = sorted(f for f in flags if not re.search(rf"{re.escape(f)}\b", text))
        assert not missing, f"nanhunt {command} --help has no {missing}"


def test_readme_links_into_the_guide() -> None:
    # GIVEN README's relative links WHEN resolved THEN each names a file, and every guide page is linked
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)#:]+(?:#[^)]*)?)\)", readme)]
    assert targets
    for t in targets:
        assert (ROOT / t).exists(), f"README links to {t}, which does not exist"
    assert {f"docs/{p.name}" for p in DOCS.glob("*.md")} <= set(targets)
    # AND the two commands a newcomer runs are named
    assert "./scripts/demo" in readme and "./scripts/test" in readme


def test_site_builds_strictly(tmp_path: Path) -> None:
    # GIVEN mkdocs.yml WHEN the site is built with warnings as errors THEN it builds, every page in the nav
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler = Collect()
    logging.getLogger("mkdocs").addHandler(handler)
    try:
        config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
        try:
            build(config)
        except Abort as e:
            raise AssertionError(f"mkdocs build --strict: {e}: {seen}") from e
    finally:
        logging.getLogger("mkdocs").removeHandler(handler)
    assert not seen, seen
    built = {p.parent.name if p.name == "index.html" else p.stem for p in (tmp_path / "site").rglob("index.html")}
    assert {p.stem for p in DOCS.glob("*.md")} - {"index"} <= built
