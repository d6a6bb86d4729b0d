"""``draftsmith``: one command line for every stage.

    draftsmith prepare RECIPE [--run-dir DIR]        data_prep: regenerate, tokenise, vocab, hidden states
    draftsmith train RECIPE [--run-dir DIR]          the recipe's draft.method (accelerate launch -m draftsmith.train works too)
    draftsmith export CKPT_OR_RUN --out DIR          vLLM-loadable draft
    draftsmith acceptance|long-context|simulate|spec-decode|compare|serve-bench|serve-table|plan|report|hub|synthesize|proxy|adapt|opd ...
    draftsmith recipe show|validate|schema [RECIPE]  the resolved recipe, a check, or every key with type/default/description
    draftsmith verify RUN_DIR                        hash every hidden-state shard against its manifest
    draftsmith bench memory RECIPE                   training memory of one step: measured (fake tensors) beside the dry run's estimate
    draftsmith --version                             the installed draftsmith's version

Each subcommand is the stage's own command line (``draftsmith SUBCOMMAND --help``).
"""

# The command line sits on top of the package: every argparse parser and ``main(argv)`` lives in
# this package (``cli/<stage>.py``, each also runnable as ``python -m draftsmith.cli.<stage>``) and
# calls the stages' typed functions; no module outside cli/ imports it
# (tests/unit/test_cli_on_top.py). The shared help layout and log format are in runtime.py, the
# recipe arguments beside load_recipe in recipe.py.

from __future__ import annotations

import importlib
import sys
from typing import Callable

# subcommand -> (module with main(argv), one-line help); the modules are imported on use only
STAGES: dict[str, tuple[str, str]] = {
    "prepare": ("draftsmith.cli.prepare", "data stages: target, regenerate, tokenize, vocab, hidden-states"),
    "synthesize": ("draftsmith.cli.synthesize", "target-written prompts (Magpie) when there is no dataset"),
    "export": ("draftsmith.cli.export", "export a checkpoint in the format vLLM loads"),
    "acceptance": ("draftsmith.cli.acceptance", "acceptance rate / length measured in vLLM"),
    "long-context": ("draftsmith.cli.long_context", "acceptance length by context-length bucket in vLLM"),
    "simulate": ("draftsmith.cli.simulate", "simulated acceptance length of a draft on prepared data (no vLLM)"),
    "spec-decode": ("draftsmith.cli.spec_decode", "draftsmith's reference speculative decoder"),
    "compare": ("draftsmith.cli.compare", "several trained drafts, one table"),
    "serve-bench": ("draftsmith.cli.serve_bench", "serving throughput / latency / cost with vllm bench serve"),
    "serve-table": ("draftsmith.cli.serve_table", "one serving table from several serve-bench runs"),
    "plan": ("draftsmith.cli.plan", "per-batch-size serving plan (vLLM / SGLang K schedule) from the profile and "
                                    "measured step costs"),
    "report": ("draftsmith.cli.report", "report.md and plots from a serving benchmark"),
    "adapt": ("draftsmith.cli.adapt", "continue a deployed draft on the traffic it served (draftsmith proxy's log)"),
    "opd": ("draftsmith.cli.opd", "on-policy distillation after SFT on a trained run directory (offline or replay)"),
    "hub": ("draftsmith.cli.hub", "Hugging Face Hub folder, model card and push"),
    "proxy": ("draftsmith.cli.proxy", "OpenAI-compatible proxy in front of vllm serve: logs served completions "
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


def main(argv: list[str] | None = None) -> int:
    from .bench import BENCHES

    argv = sys.argv[1:] if argv is None else argv
    commands = {**{k: v[1] for k, v in STAGES.items()}, "train": "train the recipe's draft method",
                "recipe": "show / validate a recipe, or print the schema of every key",
                "verify": "hash every hidden-state shard of a run against its manifest",
                "bench": "benchmarks of draftsmith itself (checkout only): bench {" + ",".join(BENCHES) + "} ..."}
    if not argv or argv[0] in ("-h", "--help"):
        from ..runtime import plain_text

        options = {"-h, --help": "show this help and exit", "-V, --version": "print draftsmith's version and exit"}
        print(plain_text(__doc__.strip()) + "\n\noptions:\n" + "\n".join(f"  {k:14s} {v}" for k, v in options.items())
              + "\n\nsubcommands:\n" + "\n".join(f"  {k:12s} {v}" for k, v in commands.items()))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"draftsmith {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .train import main as train
        return train(rest)
    if command == "recipe":
        from .recipe import main as recipe_command
        return recipe_command(rest)
    if command == "verify":
        from .verify import main as verify
        return verify(rest)
    if command == "bench":
        from .bench import main as bench
        return bench(rest)
    if command not in STAGES:
        print(f"draftsmith: unknown subcommand {command!r}; one of: {', '.join(commands)}", file=sys.stderr)
        return 2
    return _run_as(f"draftsmith {command}", STAGES[command][0], rest)
