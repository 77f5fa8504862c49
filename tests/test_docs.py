"""The README and docs/*.md say only what runs: every ```python block runs as written, every link resolves.

Layers, cheapest first:
1. pure checks: every fenced block names its language (python, bash or text: no unlabelled fragments), every
   relative link of README.md, docs/*.md and docs/bench/README.md points at an existing file (and, for a
   Markdown target with ``#anchor``, at one of its headings);
2. gloo worlds on CPU: each ```python block is written to a file of its own and run in a subprocess, with
   ``GLOO_SOCKET_IFNAME=lo`` and ``OMP_NUM_THREADS=1``. A block whose first comment line is a launch command
   (``# torchrun --standalone --nproc-per-node 2 example.py``) runs with exactly that command (``torchrun`` as
   ``python -m torch.distributed.run``); any other block runs as ``python example.py``. It must exit with 0.
   Identical blocks (the same example on two pages) run once.
4. GPU: a block whose first lines carry ``# requires: cuda`` is skipped here when CUDA is absent (run the file
   on the GPU machine to cover them).

docs/bench/*.md are measurement records, not instructions: their blocks are left alone.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK_PAGES = [*PAGES, *[p for p in [ROOT / "docs" / "bench" / "README.md"] if p.exists()]]
LANGUAGES = {"python", "bash", "text"}
SNIPPET_TIMEOUT_S = 240  # generous: a loaded 2-core machine; each block takes seconds when idle
# A launched block runs once: a non-zero exit fails the test. Every block destroys its process group before it
# exits (``test_launched_blocks_destroy_their_group``): a gloo program that skips it can abort at interpreter
# exit, after its work is done (a gloo worker thread still releasing a collective's tensors while Python
# finalizes, pytorch/pytorch#179291).

FENCE = re.compile(r"^```(\S*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(page: Path) -> list[tuple[int, str, str]]:
    """(first line number, language, text) of every fenced block of a Markdown page."""
    blocks, lang, start, lines = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if lang is None and match:
            lang, start, lines = match.group(1), number, []
        elif lang is not None and line.strip() == "```":
            blocks.append((start, lang, "\n".join(lines) + "\n"))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, f"{page.name}: the block opened at line {start} is never closed"
    return blocks


def _python_snippets() -> list:
    seen: dict[str, str] = {}
    params = []
    for page in PAGES:
        for line, lang, text in _blocks(page):
            if lang != "python":
                continue
            where = f"{page.relative_to(ROOT)}:{line}"
            if text in seen:
                continue  # the same example on two pages: run once
            seen[text] = where
            params.append(pytest.param(text, id=where))
    return params


def _header(text: str) -> tuple[bool, list[str] | None]:
    """From the block's leading comment lines: (needs CUDA, the launch command's argv or None)."""
    needs_cuda, command = False, None
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment = line[1:].strip()
        if comment == "requires: cuda":
            needs_cuda = True
        elif comment.startswith("torchrun "):
            command = shlex.split(comment)
    return needs_cuda, command


# ------------------------------------------------------------------------------------------------------
# 1. pure checks
# ------------------------------------------------------------------------------------------------------


def test_pages_exist_and_have_python_examples():
    """The page list is not empty by accident (a moved README would silently test nothing)."""
    assert (ROOT / "README.md").exists() and len(PAGES) > 1
    assert len(_python_snippets()) >= 4


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_names_its_language(page):
    """A block is a program (python), a shell command (bash) or output/pictures (text): never an unlabelled
    fragment that looks like code but is not run."""
    bad = [f"line {line}: ```{lang}" for line, lang, _ in _blocks(page) if lang not in LANGUAGES]
    assert not bad, f"{page.name}: blocks must be one of {sorted(LANGUAGES)}: {bad}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped except '-' and '_', spaces to '-'."""
    out = set()
    in_block = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_block = not in_block
        elif not in_block and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", LINK_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files(page):
    """Every relative link (and image) resolves from the page's folder; anchors into Markdown pages exist."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # links inside code are not links
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


# ------------------------------------------------------------------------------------------------------
# 2. every python block runs (gloo worlds on CPU), 4. CUDA blocks where a GPU is present
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", _python_snippets())
def test_python_block_runs_as_written(text, tmp_path):
    """The block, saved as the file its launch command names (or example.py), exits with status 0."""
    needs_cuda, command = _header(text)
    if needs_cuda and not torch.cuda.is_available():
        pytest.skip("the block needs CUDA (# requires: cuda)")
    if command is None:
        argv = [sys.executable, "example.py"]
        name = "example.py"
    else:
        assert command[0] == "torchrun", command
        scripts = [a for a in command if a.endswith(".py")]
        assert len(scripts) == 1, f"the launch command must name one script: {command}"
        name = scripts[0]
        argv = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE")}
    env.update(
        GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    )
    try:
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{' '.join(argv)}` did not finish in {SNIPPET_TIMEOUT_S}s:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, f"`{' '.join(argv)}` exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


_GUARDED_MAIN = """if __name__ == "__main__":
    dist.init_process_group("gloo")  # "nccl" on GPUs
    try:
        main()
    finally:
        dist.destroy_process_group()
"""


def test_launched_blocks_destroy_their_group():
    """Every launched (torchrun) block ends with the same guarded main: the group is destroyed before the program
    exits, also when ``main()`` raises."""
    launched = [p.values[0] for p in _python_snippets() if _header(p.values[0])[1] is not None]
    assert len(launched) >= 8
    bad = [text.splitlines()[0] for text in launched if not text.endswith(_GUARDED_MAIN)]
    assert not bad, f"these blocks must end with\n{_GUARDED_MAIN}\n{bad}"
