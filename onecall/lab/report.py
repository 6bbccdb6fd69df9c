"""The lab's report: report.md, and report.html with the same content and the plots inline.

    outcomes (one per experiment) + meta -> report_markdown() -> report.md
                                         -> markdown_to_html()  -> report.html (self-contained:
                                            plots as data:image/png;base64 URIs, inline CSS, no JS)

The markdown is the source; the HTML is converted from it by a small converter that handles exactly
the subset the lab writes (experiments included):

    # headings            paragraphs            - lists / 1. lists       > quotes
    | pipe | tables |     ``` fenced code ```   ![alt](plot.png)         `code`, **bold**, [text](url)

No italics (model answers are full of `*` and `_`). Helpers for experiments: `md_table`, `md_cell`,
`md_code`, which escape what would break that subset.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onecall.lab.base import ExperimentResult

SEED_SETTING = "Qwen3-8B, bfloat16, one A100, Hugging Face transformers (eager attention), batch 1"


@dataclass
class ExperimentOutcome:
    """One experiment as the runner saw it: its result, or the error that stopped it."""

    name: str
    title: str
    duration_s: float
    result: ExperimentResult | None = None
    error: str | None = None  # "ExceptionType: message" when it failed

    @property
    def ok(self) -> bool:
        return self.result is not None


# ---- helpers for experiments -----------------------------------------------------------------
def md_cell(value: Any) -> str:
    """A value made safe for one table cell: pipes escaped (GFM unescapes `\\|` even inside code
    spans; other backslashes stay literal there, so they are left alone), newlines shown as ↵."""
    return str(value).replace("|", "\\|").replace("\r", "").replace("\n", " ↵ ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A pipe table; cells pass through md_cell (format numbers before passing them)."""
    lines = ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def md_code(text: str, lang: str = "") -> str:
    """A fenced code block; the fence is longer than any run of backticks inside."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


# ---- report.md ---------------------------------------------------------------------------------
def report_markdown(outcomes: Sequence[ExperimentOutcome], meta: dict[str, Any], out_dir: Path) -> str:
    """The whole report: setting, the seed-vs-ours table, then one section per experiment."""
    machine = meta.get("machine", {})
    setting = f"{meta.get('model')} on {meta.get('device')}, {meta.get('dtype')}"
    gpu = machine.get("gpu") or "no GPU"
    parts = [
        "# onecall lab: the anatomy of one call",
        f"**Ours:** {setting}, kernels {meta.get('kernels')}; {machine.get('cpu_count')} CPUs, "
        f"torch threads: {machine.get('torch_threads')}; {gpu}. onecall {meta.get('onecall_version')}, "
        f"{meta.get('date')}.",
        f"**The seed:** {SEED_SETTING}. Every figure below puts the seed's value beside ours; the notes "
        "say why they differ.",
        "## Seed vs ours",
        _seed_table(outcomes, setting),
    ]
    for i, o in enumerate(outcomes, 1):
        parts.append(f"## {i}. {o.title} (`{o.name}`)")
        if o.result is None:
            parts.append(f"**Failed** after {o.duration_s:.1f} s:\n\n{md_code(o.error or 'unknown error')}")
            continue
        if o.result.markdown.strip():
            parts.append(o.result.markdown.strip())
        for plot in o.result.plots:
            parts.append(f"![{plot.stem}]({_relative(plot, out_dir)})")
        parts.append(f"Ran in {o.duration_s:.1f} s.")
    return "\n\n".join(parts) + "\n"


def _seed_table(outcomes: Sequence[ExperimentOutcome], setting: str) -> str:
    rows: list[list[str]] = []
    for o in outcomes:
        if o.result is None:
            rows.append([o.name, "(experiment failed)", "", "", (o.error or "").splitlines()[0][:200]])
        for r in o.result.seed_rows if o.result else []:
            rows.append([o.name, r.figure, r.seed, r.ours, r.note])
    return md_table(["experiment", "figure", "seed (Qwen3-8B, A100)", f"ours ({setting})", "notes"], rows)


def _relative(path: Path, out_dir: Path) -> str:
    try:
        return path.resolve().relative_to(out_dir.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


# ---- report.html -------------------------------------------------------------------------------
_CSS = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 980px; margin: 2em auto; padding: 0 1em; color: #222; }
h1, h2, h3 { line-height: 1.2; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: .3em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
code { background: #f3f3f3; padding: 0 .2em; border-radius: 3px; font-size: 90%; }
pre { background: #f6f6f6; padding: .8em; overflow-x: auto; border-radius: 4px; }
pre code { background: none; padding: 0; }
img { max-width: 100%; } figure { margin: 1em 0; } figcaption { color: #666; font-size: 13px; }
blockquote { border-left: 3px solid #ccc; margin: 1em 0; padding: 0 1em; color: #555; }
"""


def report_html(markdown: str, out_dir: Path, title: str = "onecall lab report") -> str:
    body = markdown_to_html(markdown, out_dir)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


_FENCE = re.compile(r"^(`{3,})(.*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_LIST = re.compile(r"^(\s*)([-*]|\d+\.)\s+(.*)$")
_IMAGE_LINE = re.compile(r"^!\[([^\]]*)\]\(([^)\s]+)\)$")


def markdown_to_html(markdown: str, base_dir: Path) -> str:
    """Convert the lab's markdown subset (see the module docstring); images under base_dir inline."""
    lines, out, i = markdown.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif m := _FENCE.match(line):  # 1. fenced code, up to the same fence
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group(1)), len(lines))
            out.append(f"<pre><code>{html.escape(chr(10).join(lines[i + 1 : end]))}</code></pre>")
            i = end + 1
        elif m := _HEADING.match(line):
            level = len(m.group(1))
            out.append(f"<h{level}>{_inline(m.group(2), base_dir)}</h{level}>")
            i += 1
        elif m := _IMAGE_LINE.match(line.strip()):
            alt, src = m.group(1), _image_src(m.group(2), base_dir)
            out.append(
                f'<figure><img src="{src}" alt="{html.escape(alt)}"><figcaption>{html.escape(alt)}'
                "</figcaption></figure>"
            )
            i += 1
        else:
            block, i = _take_block(lines, i)
            out.append(_block(block, base_dir))
    return "\n".join(out)


def _take_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """Lines of one table, list, quote or paragraph: up to a blank line or a different kind of block."""
    kind = _kind(lines[i])
    block = [lines[i]]
    i += 1
    while i < len(lines) and lines[i].strip() and not _FENCE.match(lines[i]) and not _HEADING.match(lines[i]):
        k = _kind(lines[i])
        if k != kind and not (kind == "list" and k == "para"):  # a list item may wrap onto the next line
            break
        block.append(lines[i])
        i += 1
    return block, i


def _kind(line: str) -> str:
    s = line.strip()
    if s.startswith("|"):
        return "table"
    if s.startswith(">"):
        return "quote"
    return "list" if _LIST.match(line) else "para"


def _block(block: list[str], base_dir: Path) -> str:
    kind = _kind(block[0])
    if kind == "table":
        return _table(block, base_dir)
    if kind == "quote":
        text = " ".join(line.strip().removeprefix(">").strip() for line in block)
        return f"<blockquote><p>{_inline(text, base_dir)}</p></blockquote>"
    if kind == "list":
        items: list[str] = []
        for line in block:
            m = _LIST.match(line)
            if m:
                items.append(m.group(3))
            else:
                items[-1] += " " + line.strip()
        tag = "ol" if block[0].strip()[0].isdigit() else "ul"
        return f"<{tag}>" + "".join(f"<li>{_inline(t, base_dir)}</li>" for t in items) + f"</{tag}>"
    return f"<p>{_inline(' '.join(line.strip() for line in block), base_dir)}</p>"


def _table(block: list[str], base_dir: Path) -> str:
    rows = [_cells(line) for line in block]
    is_separator = len(rows) > 1 and all(re.fullmatch(r":?-+:?", c.strip()) for c in rows[1])
    header, body = (rows[0], rows[2:]) if is_separator else (None, rows)
    parts = ["<table>"]
    if header is not None:
        parts.append("<tr>" + "".join(f"<th>{_inline(c, base_dir)}</th>" for c in header) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{_inline(c, base_dir)}</td>" for c in row) + "</tr>" for row in body]
    return "\n".join(parts) + "</table>"


def _cells(line: str) -> list[str]:
    """Split a table row on unescaped pipes; `\\|` in a cell becomes `|`."""
    s = line.strip().removeprefix("|")
    s = s[:-1] if s.endswith("|") and not s.endswith("\\|") else s
    cells, current, i = [], "", 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] == "|":
            current += s[i + 1]
            i += 2
            continue
        if s[i] == "|":
            cells.append(current.strip())
            current = ""
        else:
            current += s[i]
        i += 1
    return [*cells, current.strip()]


_INLINE = re.compile(r"(`+)(.+?)\1|!\[([^\]]*)\]\(([^)\s]+)\)|\[([^\]]+)\]\(([^)\s]+)\)|\*\*(.+?)\*\*")


def _inline(text: str, base_dir: Path) -> str:
    """Code spans, images, links and bold; everything else HTML-escaped."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos : m.start()]))
        if m.group(1):
            out.append(f"<code>{html.escape(m.group(2).strip() or m.group(2))}</code>")
        elif m.group(4):
            out.append(f'<img src="{_image_src(m.group(4), base_dir)}" alt="{html.escape(m.group(3))}">')
        elif m.group(6):
            out.append(f'<a href="{html.escape(m.group(6))}">{html.escape(m.group(5))}</a>')
        else:
            out.append(f"<strong>{_inline(m.group(7), base_dir)}</strong>")
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


def _image_src(src: str, base_dir: Path) -> str:
    """A PNG under base_dir becomes a data URI (the page stays one file); anything else is left as is."""
    path = base_dir / src
    if src.lower().endswith(".png") and "://" not in src and path.is_file():
        return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
    return html.escape(src)
