"""``draftsmith serve-table``: one serving table from several serve-bench runs (the command line of :mod:`draftsmith.eval.serve_table`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..eval import serve_table
from ..eval.results import ServeResults
from ..runtime import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="draftsmith serve-table", description=serve_table.__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=RESULTS_JSON",
                   help="a label and a serve-bench results.json (repeat, one per draft)")
    args = p.parse_args(argv)
    runs: dict[str, ServeResults] = {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            print(f"serve-table: {item!r}: expected LABEL=RESULTS_JSON", file=sys.stderr)
            return 2
        try:
            runs[label] = ServeResults.read(Path(path))
        except (OSError, ValueError) as exc:
            print(f"serve-table: {path}: not a serve-bench results.json ({str(exc).splitlines()[0]})", file=sys.stderr)
            return 2
    try:
        print(serve_table.serving_table(runs))
    except ValueError as exc:
        print(f"serve-table: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
