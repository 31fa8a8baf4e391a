"""The ``mla-bench`` command line."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from mla_bench.registry import ImplNotInstalled, discover


def cmd_list(args: argparse.Namespace) -> int:
    """Print every discoverable impl with its capabilities (or why it cannot load)."""
    table = Table(title="MLA implementations")
    columns = ["impl", "origin", "modes", "layouts", "dtypes", "devices", "page sizes", "heads", "query lengths",
               "lse"]
    for column in columns:
        table.add_column(column, overflow="fold")
    for name, entry in sorted(discover().items()):
        try:
            summary = entry.load().capabilities.summary()
        except ImplNotInstalled as exc:
            table.add_row(name, entry.origin, f"[yellow]not installed[/]: {exc}", *[""] * (len(columns) - 3))
            continue
        table.add_row(name, entry.origin, *[summary[c] for c in columns[2:]])
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list implementations and their capabilities").set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
