"""Every ```python block of README.md and of docs/*.md runs as pasted, each on its own in a fresh namespace (tiny
sizes, CPU); every relative link of those pages and of benchmarks/results/*.md points into the repository.

A block that cannot run here (needs an optional package, stands for the user's own code) starts with the marker
comment ``# readme-test: skip: <why>``; keep such blocks rare.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_MARKER = "# readme-test: skip:"


def python_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, section heading, code) of each ```python block."""
    out, section = [], ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i]
        if lines[i].strip() == "```python":
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            out.append((start + 1, section, "\n".join(lines[start:end]) + "\n"))
            i = end
        i += 1
    return out


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT).as_posix(), *b) for page in PAGES for b in python_blocks(page.read_text())]


def _param(page: str, line: int, section: str, code: str):
    marks = [pytest.mark.slow]
    if code.lstrip().startswith(SKIP_MARKER):
        marks.append(pytest.mark.skip(reason=code.lstrip().splitlines()[0][len(SKIP_MARKER):].strip()))
    return pytest.param(page, line, code, id=f"{page}:{line}", marks=marks)


def test_the_readme_has_python_blocks_and_the_parser_finds_them():
    assert sum(page == "README.md" for page, *_ in BLOCKS) >= 2
    assert {page for page, *_ in BLOCKS} >= {"docs/highway.md", "docs/exact.md", "docs/per-example-clipping.md"}
    doc = "## A\n```python\nx = 1\n```\ntext\n## B\n```bash\nls\n```\n```python\n# readme-test: skip: GPU\n```\n"
    assert python_blocks(doc) == [(3, "## A", "x = 1\n"), (11, "## B", "# readme-test: skip: GPU\n")]


@pytest.mark.filterwarnings("ignore::adjoint_compile.AdjointVerifyReport")  # NB: the verify block shows one
@pytest.mark.parametrize("page,line,code", [_param(*b) for b in BLOCKS])
def test_doc_block_runs_as_pasted(page, line, code, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # NB: a block that writes files writes them here
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__readme__"})


def test_every_skip_says_why():
    for page, line, _, code in BLOCKS:
        if code.lstrip().startswith(SKIP_MARKER):
            assert len(code.lstrip().splitlines()[0][len(SKIP_MARKER):].strip()) > 10, f"{page}:{line}"


def test_the_readme_is_short_and_the_user_docs_hold_no_notebook_history():
    assert len((ROOT / "README.md").read_bytes()) <= 15_000
    for page in PAGES:
        if page.name == "DESIGN.md":
            continue
        text = page.read_text()
        for pattern in (r"\bseed 00\d", r"\bissue \d+", r"\bTable \d", r"issue's (goals|sizes)"):
            assert not re.search(pattern, text), f"{page.name}: {pattern}"


def test_the_docs_link_only_files_of_the_repository():
    import adjoint_compile

    assert "docs/DESIGN.md" in (adjoint_compile.__doc__ or "")
    for doc in (*PAGES, *sorted((ROOT / "benchmarks" / "results").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).resolve().exists(), f"{doc.name} links {target}, not in the repository"
                assert ROOT in (doc.parent / target).resolve().parents or (doc.parent / target).resolve() == ROOT
