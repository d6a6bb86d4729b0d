"""The hidden-state shard tools (:mod:`draftsmith.data_prep.shards`):

    python -m draftsmith.cli.hidden_states convert SRC_DIR DST_DIR --dtype float8_e4m3fn
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..data_prep.shards import STORAGE_DTYPES, convert_shards, shard_bytes_per_token
from ..fileio import ShardError
from ..runtime import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="re-encode a shard directory (e.g. bf16 -> row-scaled fp8)",
                       formatter_class=HelpFormatter)
    c.add_argument("src", type=Path, help="the shard directory to read (holding manifest.json)")
    c.add_argument("dst", type=Path, help="the shard directory to write")
    c.add_argument("--dtype", default="float8_e4m3fn", choices=STORAGE_DTYPES, help="storage dtype of the new shards")
    args = p.parse_args(argv)
    try:
        m = convert_shards(args.src, args.dst, args.dtype)
    except ShardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"shards": len(m["shards"]), "tokens": m["num_tokens"], "dtype": m["dtype"],
                      "src_bytes_per_token": round(shard_bytes_per_token(args.src), 1),
                      "dst_bytes_per_token": round(shard_bytes_per_token(args.dst), 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
