"""``draftsmith report``: report.md and plots from a serving benchmark (the command line of :mod:`draftsmith.eval.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..eval import report as rep
from ..runtime import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=rep.__doc__, formatter_class=HelpFormatter)
    p.add_argument("run_dir", type=Path, help="the serve_bench --out-dir (holds results.json)")
    args = p.parse_args(argv)
    try:
        report = rep.write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
