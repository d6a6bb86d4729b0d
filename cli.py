"""``draftsmith``: one command line for every stage.

    draftsmith prepare RECIPE [--run-dir DIR]        data_prep: regenerate, tokenise, vocab, hidden states
    draftsmith train RECIPE [--run-dir DIR]          the recipe's draft.method (accelerate launch train/<method>.py works too)
    draftsmith export CKPT_OR_RUN --out DIR          vLLM-loadable draft
    draftsmith acceptance|long-context|simulate|spec-decode|compare|serve-bench|serve-table|report|hub|synthesize|proxy|adapt ...
    draftsmith recipe show|validate|schema [RECIPE]  the resolved recipe, a check, or every key with type/default/description
    draftsmith verify RUN_DIR                        hash every hidden-state shard against its manifest
    draftsmith bench memory RECIPE                   training memory of one step: measured (fake tensors) beside the dry run's estimate

Each subcommand is the stage's own command line (``draftsmith SUBCOMMAND --help``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .recipe import Recipe

class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The help layout of every draftsmith command line: the description as written (usage
    examples keep their lines) and each flag's default appended, unless it has none (None,
    False, ``[]``) or its help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] or "(default" in text:
            return text
        return super()._get_help_string(action)


def setup_logging() -> None:
    """The log format of every draftsmith command line (INFO and up, to stderr); call it once,
    first thing in a ``main``."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every entry script shares: the recipe file and ``--set`` overrides."""
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set train.lr=3e-4 (repeatable)")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """Load ``args.recipe`` with ``args.overrides`` (:func:`add_recipe_arguments`).

    Raises:
        SystemExit(2): the recipe does not validate (the message is printed to stderr).
    """
    from .recipe import RecipeError, load_recipe

    try:
        return load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


# subcommand -> (module with main(argv), one-line help); the modules are imported on use only
STAGES: dict[str, tuple[str, str]] = {
    "prepare": ("draftsmith.data_prep.prepare", "data stages: target, regenerate, tokenize, vocab, hidden-states"),
    "synthesize": ("draftsmith.data_prep.synthesize", "target-written prompts (Magpie) when there is no dataset"),
    "export": ("draftsmith.eval.export", "export a checkpoint in the format vLLM loads"),
    "acceptance": ("draftsmith.eval.acceptance", "acceptance rate / length measured in vLLM"),
    "long-context": ("draftsmith.eval.long_context", "acceptance length by context-length bucket in vLLM"),
    "simulate": ("draftsmith.eval.simulate", "simulated acceptance length of a draft on prepared data (no vLLM)"),
    "spec-decode": ("draftsmith.eval.spec_decode", "draftsmith's reference speculative decoder"),
    "compare": ("draftsmith.eval.compare_drafts", "several trained drafts, one table"),
    "serve-bench": ("draftsmith.eval.serve_bench", "serving throughput / latency / cost with vllm bench serve"),
    "serve-table": ("draftsmith.eval.serve_table", "one serving table from several serve-bench runs"),
    "report": ("draftsmith.eval.report", "report.md and plots from a serving benchmark"),
    "adapt": ("draftsmith.serve.adapt", "continue a deployed draft on the traffic it served (draftsmith proxy's log)"),
    "hub": ("draftsmith.eval.hub", "Hugging Face Hub folder, model card and push"),
    "proxy": ("draftsmith.serve.proxy", "OpenAI-compatible proxy in front of vllm serve: logs served completions "
                                        "(draftsmith adapt reads them), swaps drafts with no failed request"),
}


def _stage_main(module: str) -> Callable[[list[str]], int]:
    return importlib.import_module(module).main


def _run_as(prog: str, module: str, argv: list[str]) -> int:
    """``module``'s ``main(argv)`` with ``sys.argv[0]`` set to ``prog`` while it runs (its parser
    names itself ``prog`` in usage lines and errors), put back afterwards."""
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        return _stage_main(module)(argv)
    finally:
        sys.argv = saved


TRAIN_DOC = """Train the draft of a recipe: the entry script of its draft.method (train/<method>.py; its
flags, below, are every method's), after preparing whatever of RUN_DIR/data is missing.

    draftsmith train RECIPE.yaml [--run-dir DIR] [--resume|--overwrite] [--set train.lr=3e-4 ...]
    draftsmith train RECIPE.yaml --dry-run         size and memory estimates, no weights
    draftsmith train RECIPE.yaml --help            the method's own description
"""


def train(argv: list[str]) -> int:
    """``train/<draft.method>.py`` of the recipe (its own flags follow). Without a recipe first,
    the flags every method's entry script shares are parsed here: ``--help`` prints them (exit 0),
    no recipe at all is a usage error (exit 2)."""
    from .methods import get_method
    from .recipe import RecipeError, load_recipe
    from .train.method_base import build_parser

    parser = build_parser(TRAIN_DOC)
    parser.prog = "draftsmith train"
    if not argv or argv[0].startswith("-"):
        args = parser.parse_args(argv)  # --help: exit 0; no recipe: exit 2
    else:  # `draftsmith train RECIPE --help` is the method's help: the method is needed first
        args, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    try:
        method = load_recipe(args.recipe, args.overrides).draft.method
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return 2
    return _run_as("draftsmith train", get_method(method).train_module, argv)


def build_verify_parser() -> argparse.ArgumentParser:
    """The parser of ``draftsmith verify``."""
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="draftsmith verify", formatter_class=HelpFormatter,
        description="Fully check every hidden-state shard of a run (file size, safetensors header, sha256 "
                    "against the manifest) and print a summary; exit 1 on any bad shard.")
    p.add_argument("run_dir", type=Path, help="run directory (its shards are RUN_DIR/data/hidden_states), "
                                              "or a shard directory holding manifest.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def verify(argv: list[str]) -> int:
    """``draftsmith verify RUN_DIR``: exit 0 when every shard checks out, 1 otherwise."""
    import json

    from .data_prep.shards import MANIFEST, verify_shards
    from .layout import RunLayout

    args = build_verify_parser().parse_args(argv)
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


def build_recipe_parser() -> argparse.ArgumentParser:
    """The parser of ``draftsmith recipe show|validate|schema``."""
    p = argparse.ArgumentParser(prog="draftsmith recipe", description="Inspect recipes.", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    for action, text in (("show", "print the resolved recipe (defaults filled in, --set applied)"),
                         ("validate", "check a recipe; exit 2 naming the key when it is invalid")):
        add_recipe_arguments(sub.add_parser(action, help=text, description=text, formatter_class=HelpFormatter))
    text = "every recipe key with its type, default and description"
    schema = sub.add_parser("schema", help=text, description=text, formatter_class=HelpFormatter)
    schema.add_argument("--format", choices=["table", "json"], default="table", help="output format")
    return p


def recipe_command(argv: list[str]) -> int:
    import json

    import yaml

    from .recipe import RecipeError, load_recipe, recipe_schema

    args = build_recipe_parser().parse_args(argv)
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
        print(f"{args.recipe}: valid ({recipe.draft.method}, target {recipe.target.name_or_path})")
    return 0


# ``draftsmith bench <what>``: the benchmarks of draftsmith itself, in the checkout's top-level
# benchmarks/ folder (outside the installed package; modules imported on use only)
BENCHES: dict[str, str] = {
    "memory": "peak training memory of the recipe's step beside the dry run's estimate (fake tensors: any machine)",
    "step": "ops, matmul FLOPs, bytes and an H100 / H200 roofline time of the recipe's step (fake tensors: any machine)",
    "gpu": "the real training step on a GPU: tok/s, MFU, CUDA peak memory; the target's capture",
    "hidden-states": "hidden-state capture throughput and the capture's host memory",
    "regenerate": "regeneration tok/s per engine (in-process, vLLM offline, vLLM server)",
    "data-memory": "host memory of the training data loader per rank",
    "muon": "the training step's time with Muon (its Newton-Schulz dtype) against AdamW, interleaved",
}


def bench(argv: list[str]) -> int:
    """``draftsmith bench NAME ...``: ``python -m benchmarks.<name>`` of the checkout this package runs from."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        lines = [f"  {k:14s} {v}" for k, v in BENCHES.items()]
        print("usage: draftsmith bench {" + ",".join(BENCHES) + "} [...]\n\nbenchmarks:\n" + "\n".join(lines),
              file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    checkout = Path(__file__).resolve().parent
    if not (checkout / "benchmarks" / "__init__.py").is_file():
        print(f"draftsmith bench: no benchmarks/ folder beside {checkout}; the benchmarks ship with the "
              "repository, not the wheel: run them from a checkout (pip install -e .)", file=sys.stderr)
        return 2
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    return _run_as(f"draftsmith bench {argv[0]}", "benchmarks." + argv[0].replace("-", "_"), argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {**{k: v[1] for k, v in STAGES.items()}, "train": "train the recipe's draft method",
                "recipe": "show / validate a recipe, or print the schema of every key",
                "verify": "hash every hidden-state shard of a run against its manifest",
                "bench": "benchmarks of draftsmith itself (checkout only): bench {" + ",".join(BENCHES) + "} ..."}
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nsubcommands:\n" + "\n".join(f"  {k:12s} {v}" for k, v in commands.items()))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train(rest)
    if command == "recipe":
        return recipe_command(rest)
    if command == "verify":
        return verify(rest)
    if command == "bench":
        return bench(rest)
    if command not in STAGES:
        print(f"draftsmith: unknown subcommand {command!r}; one of: {', '.join(commands)}", file=sys.stderr)
        return 2
    return _run_as(f"draftsmith {command}", STAGES[command][0], rest)


if __name__ == "__main__":
    sys.exit(main())
