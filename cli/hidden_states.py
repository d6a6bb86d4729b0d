"""The hidden-state shard tools (:mod:`draftsmith.data_prep.shards`):

    python -m draftsmith.cli.hidden_states convert SRC_DIR DST_DIR --dtype float8_e4m3fn
    python -m draftsmith.cli.hidden_states score RUN_DIR [--device cuda]

``score`` computes ``data.select``'s per-sequence scores (:mod:`draftsmith.data_prep.scores`)
for a run whose shards were captured before capture wrote them: from the stored final states, the
target of ``RUN_DIR/data/target.json`` and the draft vocab of ``RUN_DIR/data/vocab.safetensors``,
into ``RUN_DIR/data/hidden_states/scores.json`` (resumable; shards already scored are skipped).
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
    sc = sub.add_parser("score", help="compute data.select's per-sequence scores of a prepared run's shards",
                        formatter_class=HelpFormatter)
    sc.add_argument("run_dir", type=Path, help="the run directory (its data/ holds target.json, vocab.safetensors "
                    "and hidden_states/)")
    sc.add_argument("--device", default="cpu", help="where the target's lm_head rows score the states")
    args = p.parse_args(argv)
    if args.command == "score":
        return _score(args.run_dir, args.device)
    try:
        m = convert_shards(args.src, args.dst, args.dtype)
    except ShardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"shards": len(m["shards"]), "tokens": m["num_tokens"], "dtype": m["dtype"],
                      "src_bytes_per_token": round(shard_bytes_per_token(args.src), 1),
                      "dst_bytes_per_token": round(shard_bytes_per_token(args.dst), 1)}, indent=1))
    return 0


def _score(run_dir: Path, device: str) -> int:
    """``score``: exit 0 with a JSON summary; 1 with one line naming the missing file or damaged shard."""
    from ..data_prep.scores import SequenceScorer, score_shards
    from ..layout import RunLayout
    from ..target import TargetInfo

    paths = RunLayout(run_dir).data
    for need, stage in ((paths.target_info, "target"), (paths.vocab, "vocab")):
        if not need.is_file():
            print(f"error: {need} missing: run draftsmith prepare RECIPE --run-dir {run_dir} --stage {stage}",
                  file=sys.stderr)
            return 1
    scorer = SequenceScorer.for_target(Path(TargetInfo.read(paths.target_info).path), paths.vocab)
    try:
        summary = score_shards(paths.hidden_states, scorer, device)
    except ShardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(dict(summary, file=str(paths.hidden_states / "scores.json")), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
