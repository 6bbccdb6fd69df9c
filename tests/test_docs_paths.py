"""The README is a map, and every path it and docs/ name is real (no model, no server).

    check                                       over
    README.md has at most 300 lines             README.md
    every relative link (and its #anchor)       README.md and docs/**/*.md
      points at something that exists
    README links every page in docs/            docs/*.md
    every repository path named exists          README.md and docs/**/*.md

Which words are paths (write paths so that this rule sees them: one path, on one line, in backticks
or bare, so that a rename can rewrite it with sed):

1. A token is a maximal run of `[A-Za-z0-9_.*/-]` that holds a "/" and does not follow a letter,
   digit, ".", "/", "-" or ":" (so URLs, routes like `/v1/models`, `~/.cache/...` and `../x` are
   not read as repository paths). Trailing dots are dropped (the end of a sentence). Markdown link
   targets are not tokens (they are links, below); link texts are.
2. Rooted: a token whose first component is `onecall`, `tests`, `benchmarks`, `docs` or `.ci` is
   resolved from the repository root (`tests/engine/test_engine.py`, `docs/lab/`).
3. Module-relative: a token whose first component is a folder of onecall/ (engine, model, server,
   ...) and that ends in "/" or a source file's extension (_EXTENSION: .py, .c, .html, .md, ...),
   such as `engine/scheduler.py`, `kernels/cpu/csrc/gemm.c` or `server/`, and any other token ending in
   `.py`, `.c` or `.h`, is resolved under onecall/. So a stale module path fails even once its
   folder is gone.
4. Anything else (`path/to/model.gguf`, `text/event-stream`, `tokens/s`, `Q8_0/Q6_K`) is prose.
5. A token with `*` must match at least one file (a glob).
6. Layout trees: a fenced block whose first line is `onecall/` is a tree. The first word of each of
   its lines, if it ends in "/" or a source file's extension (a trailing ":" or "," dropped), is an
   entry; its folder is the nearest entry above it that is a folder and is less indented (none: the
   repository root). The rest of each line is read by rules 1-5.
7. Folders a fresh checkout lacks because tests write them (GENERATED) count as existing.

Links: the target of `[text](target)` or `![alt](target)` that is not a URL is resolved against the
page's own folder; an `#anchor` must be one of the target page's headings, slugged as GitHub does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_README_LINES = 300
ROOTED = ("onecall", "tests", "benchmarks", "docs", ".ci")
MODULE_SUFFIXES = (".py", ".c", ".h")
GENERATED = {"tests/artifacts/"}  # the browser test's screenshots (.gitignore)

_TOKEN = re.compile(r"(?<![\w./:-])[\w.*/-]+")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)\s]+\)")  # a link, to keep its text only
_FENCE = re.compile(r"^\s*(```|~~~)")
_EXTENSION = re.compile(r"\.(py|pyi|c|h|cc|cpp|cu|html|js|css|md|png|svg|json|toml|txt|sh|cfg|ini|yaml|yml)$")


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown page under docs/, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


# ---- reading a page ---------------------------------------------------------------------------
def _blocks(text: str) -> Iterator[tuple[bool, bool, int, list[str]]]:
    """(is_code, is_tree, number of its first line, lines) for each run of prose and each fenced
    block, in order; a fence's own lines belong to neither."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        is_code = bool(_FENCE.match(lines[i]))
        j = i + 1 if is_code else i
        while j < len(lines) and not _FENCE.match(lines[j]):
            j += 1
        body = lines[i + 1 if is_code else i : j]
        first = next((line for line in body if line.strip()), "")
        is_tree = is_code and first.split()[:1] == ["onecall/"] and not first.startswith(" ")
        yield is_code, is_tree, (i + 2 if is_code else i + 1), body
        i = j + 1 if is_code else j


def _is_entry(word: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", word)) and (
        word.endswith("/") or bool(_EXTENSION.search(word))
    )


def _tree_entries(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(entry path from the root, the rest of the line) for each line of a layout tree (rule 6)."""
    folders: list[tuple[int, str]] = []  # (indent, path from the root) of the open folder entries
    for line in lines:
        words = line.split(maxsplit=1)
        if not words:
            yield "", ""
            continue
        word = words[0].rstrip(":,")
        rest = words[1] if len(words) > 1 else ""
        if not _is_entry(word):
            yield "", line
            continue
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = (folders[-1][1] if folders else "") + word
        if word.endswith("/"):
            folders.append((indent, path))
        yield path, rest


def path_of(token: str, onecall_folders: set[str]) -> str | None:
    """The repository path a token names, or None when it is prose (rules 1-4)."""
    token = token.rstrip(".")
    if "/" not in token:
        return None
    first = token.split("/", 1)[0]
    if first in ROOTED:
        return token
    if first in onecall_folders and (token.endswith("/") or _EXTENSION.search(token)):
        return "onecall/" + token
    if token.endswith(MODULE_SUFFIXES) and first not in ("", ".", ".."):
        return "onecall/" + token
    return None


def named_paths(page: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line number, repository path) for every path the page names."""
    folders = {p.name for p in (root / "onecall").iterdir() if p.is_dir() and not p.name.startswith("_")}
    found: list[tuple[int, str]] = []
    for _, is_tree, first, lines in _blocks(page.read_text(encoding="utf-8")):
        entries = _tree_entries(lines) if is_tree else (("", line) for line in lines)
        for number, (entry, rest) in enumerate(entries, first):
            if entry:
                found.append((number, entry))
            for token in _TOKEN.findall(_LINK_TEXT.sub(r"\1", rest)):
                path = path_of(token, folders)
                if path is not None:
                    found.append((number, path))
    return found


def exists(path: str, root: Path = ROOT) -> bool:
    if path in GENERATED:
        return True
    if "*" in path:
        return any(root.glob(path))
    return (root / path).exists()


# ---- links ------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading's second anchor gets "-1", ...)."""
    seen: dict[str, int] = {}
    for is_code, _, _, lines in _blocks(page.read_text(encoding="utf-8")):
        for line in () if is_code else lines:
            m = re.match(r"#{1,6}\s+(.*)", line)
            if m is None:
                continue
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            if n:
                seen[f"{slug}-{n}"] = 1
    return set(seen)


def _prose_links(page: Path) -> list[str]:
    """Link targets outside fenced code blocks."""
    return [
        target
        for is_code, _, _, lines in _blocks(page.read_text(encoding="utf-8"))
        if not is_code
        for line in lines
        for target in _LINK.findall(line)
    ]


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in _prose_links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{target}: no heading with that anchor in {linked.name}")
    return problems


# ---- the tests --------------------------------------------------------------------------------
PAGES = doc_pages()


def test_readme_is_a_map_of_at_most_300_lines() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail into docs/"
    )


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _prose_links(ROOT / "README.md")}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    missing = [p.relative_to(ROOT).as_posix() for p in pages if p.resolve() not in linked]
    assert not missing, f"README.md does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, f"{page.relative_to(ROOT)}: broken links: {problems}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_exist(page: Path) -> None:
    missing = [f"line {n}: {path}" for n, path in named_paths(page) if not exists(path)]
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize(
    ("token", "path"),
    [
        ("onecall/engine/engine.py", "onecall/engine/engine.py"),
        ("tests/engine/test_engine.py.", "tests/engine/test_engine.py"),
        ("engine/scheduler.py", "onecall/engine/scheduler.py"),
        ("kernels/cpu/csrc/gemm.c", "onecall/kernels/cpu/csrc/gemm.c"),
        ("server/", "onecall/server/"),
        ("csrc/gemm.c", "onecall/csrc/gemm.c"),  # a sloppy relative path is checked, and fails
        ("path/to/model.gguf", None),
        ("text/event-stream", None),
        ("tokens/s", None),
        ("Q8_0/Q6_K", None),
    ],
)
def test_the_path_rule(token: str, path: str | None) -> None:
    assert path_of(token, {"engine", "model", "server", "text"}) == path


def test_the_rule_reads_trees_and_skips_urls(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `engine/engine.py`, http://127.0.0.1:8000/v1/models and ~/.cache/onecall/kernels.\n"
        "```\nonecall/\n  engine/            the loop\n    gone.py          a module, see engine/tp/\n"
        "tests/  the suite\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "onecall" / "engine").mkdir(parents=True)
    paths = [p for _, p in named_paths(page, tmp_path)]
    assert paths == ["onecall/engine/engine.py", "onecall/", "onecall/engine/",
                     "onecall/engine/gone.py", "onecall/engine/tp/", "tests/"]  # fmt: skip
