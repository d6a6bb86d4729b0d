"""``draftsmith recipe show|validate|schema``: the resolved recipe, a check, or every key."""

from __future__ import annotations

import argparse
import sys

from ..recipe import add_recipe_arguments
from ..runtime import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``draftsmith recipe show|validate|schema``."""
    p = argparse.ArgumentParser(prog="draftsmith recipe", description="Inspect recipes.", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    for action, text in (("show", "print the resolved recipe (defaults filled in, --set applied)"),
                         ("validate", "check a recipe; exit 2 naming the key when it is invalid, or when the vLLM "
                     "release (--vllm, default: the installed one) does not serve its draft.method")):
        parser = sub.add_parser(action, help=text, description=text, formatter_class=HelpFormatter)
        add_recipe_arguments(parser)
        if action == "validate":
            parser.add_argument("--vllm", metavar="VERSION",
                                help="the vLLM release draft.method must be served by, one draftsmith has checked: "
                                "0.32 or 0.33 (default: the installed vLLM, else no check; docs/vllm_releases.md)")
    text = "every recipe key with its type, default and description"
    schema = sub.add_parser("schema", help=text, description=text, formatter_class=HelpFormatter)
    schema.add_argument("--format", choices=["table", "json"], default="table", help="output format")
    return p


def main(argv: list[str] | None = None) -> int:
    import json

    import yaml

    from ..recipe import RecipeError, load_recipe, recipe_schema

    args = build_parser().parse_args(argv)
    if args.action == "schema":
        rows = recipe_schema()
        if args.format == "json":
            print(json.dumps(rows, indent=1, default=str))
        else:
            for r in rows:
                default = "" if r["type"] == "section" else f" = {json.dumps(r['default'], default=str)}"
                print(f"{r['key']}: {r['type']}{default}\n    {r['description']}")
        return 0
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.action == "show":
        print(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False), end="")
    else:
        from ..vllm_bridge.releases import check_vllm_serves_method, installed_vllm_version, known_release

        if args.vllm is not None:
            try:
                known_release(args.vllm)
            except ValueError as exc:
                print(f"error: --vllm {args.vllm}: {exc}", file=sys.stderr)
                return 2
        try:
            check_vllm_serves_method(recipe.draft.method, args.vllm if args.vllm is not None else installed_vllm_version())
        except ValueError as exc:
            print(f"{args.recipe}: draft.method: {exc}", file=sys.stderr)
            return 2
        print(f"{args.recipe}: valid ({recipe.draft.method}, target {recipe.target.name_or_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
