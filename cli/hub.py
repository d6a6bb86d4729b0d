"""``draftsmith hub``: a Hub folder, model card and push (the command line of :mod:`draftsmith.eval.hub`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..eval import hub
from ..runtime import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=hub.__doc__, formatter_class=HelpFormatter)
    p.add_argument("draft", type=Path, help="exported draft directory (draftsmith export); its "
                   "speculation_profile.json (draftsmith acceptance) is copied, shown in the card and pushed, "
                   "and refused when it records other weights (sha256) or another method than the export's")
    p.add_argument("--out", type=Path, required=True, help="Hub folder to write")
    p.add_argument("--repo-id", required=True, help="USER/NAME on the Hub (also written into the vllm serve line)")
    p.add_argument("--recipe", type=Path, help="the run's recipe.yaml (training data in the card)")
    p.add_argument("--acceptance", type=Path, help="draftsmith acceptance --out JSON")
    p.add_argument("--serve", type=Path, help="draftsmith serve-bench results.json (in its --out-dir)")
    p.add_argument("--license", help="the card's license (default: the target's when its local model card "
                   "names one, else 'other')")
    p.add_argument("--push", action="store_true", help="create the repo and upload the folder")
    p.add_argument("--private", action="store_true", help="create the repo private")
    args = p.parse_args(argv)
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(args.repo_id)
    except HFValidationError as exc:
        p.error(f"argument --repo-id: {args.repo_id!r} is not a Hub repo id ({exc}); e.g. --repo-id USER/NAME")
    try:
        folder = hub.prepare_folder(args.draft, args.out, args.repo_id, args.recipe, args.acceptance, args.serve,
                                args.license)
        print(f"Hub folder: {folder}")
        if args.push:
            print(f"pushed {args.repo_id}: {hub.push(folder, args.repo_id, args.private)}")
    except hub.HubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
