"""``kvproto diagram``: state diagrams and tables generated from the transition tables."""

from __future__ import annotations

import argparse

from kvproto.lifecycle import D_TRANSITIONS, P_TRANSITIONS, markdown_table, mermaid


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--side", choices=("producer", "consumer"), default="producer")
    p.add_argument("--format", choices=("mermaid", "table"), default="mermaid")


def render(side: str, fmt: str) -> str:
    rows = P_TRANSITIONS if side == "producer" else D_TRANSITIONS
    return mermaid(rows) if fmt == "mermaid" else markdown_table(rows)


def run(args: argparse.Namespace) -> int:
    print(render(args.side, args.format), end="")
    return 0
