"""``draftsmith verify RUN_DIR``: hash every hidden-state shard of a run against its manifest."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..runtime import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``draftsmith verify``."""
    p = argparse.ArgumentParser(
        prog="draftsmith verify", formatter_class=HelpFormatter,
        description="Fully check every hidden-state shard of a run (file size, safetensors header, sha256 "
                    "against the manifest) and print a summary; exit 1 on any bad shard.")
    p.add_argument("run_dir", type=Path, help="run directory (its shards are RUN_DIR/data/hidden_states), "
                                              "or a shard directory holding manifest.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """``draftsmith verify RUN_DIR``: exit 0 when every shard checks out, 1 otherwise."""
    import json

    from ..data_prep.shards import MANIFEST, verify_shards
    from ..layout import RunLayout

    args = build_parser().parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir}: no such directory; pass a run directory (draftsmith prepare ... --run-dir "
              "RUN_DIR) or a shard directory holding manifest.json", file=sys.stderr)
        return 1
    directory = args.run_dir
    if not (directory / MANIFEST).is_file() and not any(directory.glob("manifest.rank-*.json")):
        directory = RunLayout(args.run_dir).data.hidden_states
    result = verify_shards(directory, progress=not args.no_progress)
    for problem in result["problems"]:
        print(f"error: {problem}", file=sys.stderr)
    for bad in result["bad"]:
        print(f"bad shard: {bad['error']}", file=sys.stderr)
    print(json.dumps({"dir": result["dir"], "shards": result["shards"], "bytes": result["bytes"],
                      "seconds": result["seconds"], "bad_files": [b["file"] for b in result["bad"]],
                      "ok": not (result["bad"] or result["problems"])}, indent=1))
    return 1 if result["bad"] or result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
