"""``kvproto diagram``: state diagrams and tables generated from the transition tables.

The README's diagrams and spec/PROTOCOL.md's tables are generated here, between marker
comments, never edited by hand: ``kvproto diagram --update-docs`` rewrites them and
``kvproto diagram --check-docs`` (and the test suite) fails when they are stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from kvproto.lifecycle import (
    D_DONE,
    D_FAILED,
    D_NEW,
    D_TRANSITIONS,
    EXPIRED,
    FREED,
    P_TRANSITIONS,
    UNREGISTERED,
    Transition,
)

ROOT = Path(__file__).resolve().parent.parent


def mermaid(transitions: Sequence[Transition] = P_TRANSITIONS, *, title: str = "") -> str:
    """Render a transition table as a Mermaid state diagram (generated, never drawn)."""
    lines = ["stateDiagram-v2"]
    if title:
        lines.insert(0, f"%% {title}")
    seen: set[tuple[str, str, str]] = set()
    for t in transitions:
        if t.src == t.dst and t.free is None and not t.renew:
            continue  # self-loops that only count are documented in the table, not drawn
        label = f"{t.event} [{t.guard}]" + (f" / {t.effect}" if t.effect else "")
        key = (t.src, t.dst, label)
        if key in seen:
            continue
        seen.add(key)
        src = "[*]" if t.src in (UNREGISTERED, D_NEW) else t.src
        lines.append(f"    {src} --> {t.dst}: {label}")
    for term in (EXPIRED, FREED, D_DONE, D_FAILED):
        if any(t.dst == term for t in transitions):
            lines.append(f"    {term} --> [*]")
    return "\n".join(lines) + "\n"


def markdown_table(transitions: Sequence[Transition]) -> str:
    rows = ["| state | event | guard | next state | effect | note |",
            "| --- | --- | --- | --- | --- | --- |"]
    for t in transitions:
        rows.append(f"| {t.src} | {t.event} | {t.guard} | {t.dst} | {t.effect or '-'} | {t.doc} |")
    return "\n".join(rows) + "\n"


def render(side: str, fmt: str) -> str:
    rows = P_TRANSITIONS if side == "producer" else D_TRANSITIONS
    return mermaid(rows) if fmt == "mermaid" else markdown_table(rows)


# (file, marker name, side, format)
DOC_BLOCKS: tuple[tuple[str, str, str, str], ...] = (
    ("README.md", "P DIAGRAM", "producer", "mermaid"),
    ("README.md", "D DIAGRAM", "consumer", "mermaid"),
    ("spec/PROTOCOL.md", "P TABLE", "producer", "table"),
    ("spec/PROTOCOL.md", "D TABLE", "consumer", "table"),
)


def block_text(side: str, fmt: str) -> str:
    body = render(side, fmt)
    return f"```mermaid\n{body}```\n" if fmt == "mermaid" else body


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN {name} -->\n)(.*?)(<!-- END {name} -->)", re.S)


def sync_docs(root: Path = ROOT, *, write: bool) -> list[str]:
    """Return the stale blocks (as 'file: marker'); rewrite them when ``write``."""
    stale: list[str] = []
    texts: dict[str, str] = {}
    for fname, name, side, fmt in DOC_BLOCKS:
        path = root / fname
        text = texts.get(fname)
        if text is None:
            text = texts[fname] = path.read_text(encoding="utf-8") if path.exists() else ""
        m = _pattern(name).search(text)
        want = block_text(side, fmt)
        if m is None:
            stale.append(f"{fname}: markers <!-- BEGIN {name} --> / <!-- END {name} --> missing")
            continue
        if m.group(2) != want:
            stale.append(f"{fname}: {name}")
            texts[fname] = text[:m.start(2)] + want + text[m.end(2):]
    if write:
        for fname, text in texts.items():
            path = root / fname
            if path.exists() and path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
    return stale


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--side", choices=("producer", "consumer"), default="producer")
    p.add_argument("--format", choices=("mermaid", "table"), default="mermaid")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--update-docs", action="store_true",
                   help="regenerate the diagrams/tables in README.md and spec/PROTOCOL.md")
    g.add_argument("--check-docs", action="store_true",
                   help="exit 1 when README.md or spec/PROTOCOL.md disagree with the tables")


def run(args: argparse.Namespace) -> int:
    if args.update_docs or args.check_docs:
        stale = sync_docs(write=args.update_docs)
        for s in stale:
            print(f"{'updated' if args.update_docs else 'stale'}: {s}", file=sys.stderr)
        missing = [s for s in stale if "missing" in s]
        return 1 if (args.check_docs and stale) or missing else 0
    print(render(args.side, args.format), end="")
    return 0
