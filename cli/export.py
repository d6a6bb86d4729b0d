"""``draftsmith export``: a checkpoint in the format vLLM loads (the command line of :mod:`draftsmith.eval.export`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from ..eval import export as ex
from ..runtime import DTYPE_CHOICES, HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``eval/export.py`` (``draftsmith export``)."""
    p = argparse.ArgumentParser(description=ex.__doc__, formatter_class=HelpFormatter)
    p.add_argument("checkpoint", type=Path, help="RUN_DIR/checkpoints/step-N, or RUN_DIR (latest checkpoint)")
    p.add_argument("out_dir", type=Path, nargs="?", help="output directory (or --out)")
    p.add_argument("--out", type=Path, help="output directory (or OUT_DIR)")
    p.add_argument("--legacy", action="store_true", help="EAGLE-3: legacy LlamaForCausalLMEagle3 layout")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K written as the default proposal length (EAGLE-3 default: eval.num_speculative_tokens "
                        "of the recipe saved with the checkpoint, else 3; DFlash / P-EAGLE default: the trained K)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="storage dtype of the floating-point weights; auto: bfloat16 when this machine has a "
                   "CUDA GPU, float32 otherwise (vLLM casts the weights to its own --dtype when it loads the draft)")
    p.add_argument("--raw-weights", action="store_true",
                   help="export the trained weights of a checkpoint trained with train.ema_decay, not their average "
                        "(ema.safetensors, the default where the checkpoint has one)")
    p.add_argument("--vllm", metavar="VERSION",
                   help="the vLLM release the export must load in, one draftsmith has checked: 0.32 or 0.33 "
                        "(0.32.0, 0.33.1 name the same lines; default: the installed vLLM, else no check); an "
                        "export it cannot load is refused naming the version and the config key "
                        "(docs/vllm_releases.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    from ..layout import ExportError
    from ..methods import get_method
    from ..train.checkpoint import read_draft
    from ..train.components.ema import EMA_WEIGHTS_NAME
    from ..run_lock import RunDirLockedError, command_line, run_dir_lock
    from ..vllm_bridge.releases import installed_vllm_version, known_release

    p = build_parser()
    args = p.parse_args(argv)
    if (args.out_dir is None) == (args.out is None):
        p.error("give the output directory once: OUT_DIR or --out OUT_DIR")
    if args.vllm is not None:
        try:  # exit 1, as every --vllm refusal of export (an export that release cannot load) does
            known_release(args.vllm)
        except ValueError as exc:
            print(f"error: --vllm {args.vllm}: {exc}", file=sys.stderr)
            return 1
    if not args.checkpoint.exists():
        print(f"error: {args.checkpoint}: no such checkpoint or run directory; pass RUN_DIR/checkpoints/step-N "
              "or the RUN_DIR of `draftsmith train`", file=sys.stderr)
        return 1
    try:
        ckpt = ex.resolve_checkpoint(args.checkpoint)
        k = args.num_speculative_tokens
        if k is None and get_method(read_draft(ckpt, weights=False).method).format.k_from_recipe:
            k = ex.saved_num_speculative_tokens(ckpt)
        vllm = args.vllm if args.vllm is not None else installed_vllm_version()
        out_dir = args.out or args.out_dir
        with run_dir_lock(run, command_line(argv, "draftsmith export")) if (run := run_of(ckpt, out_dir)) \
                else contextlib.nullcontext():  # an export into its run directory is one of the run's writers
            out = ex.export(ckpt, out_dir, args.legacy, k, args.dtype, vllm_version=vllm, average=not args.raw_weights)
    except RunDirLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    averaged = (ckpt / EMA_WEIGHTS_NAME).is_file() and not args.raw_weights
    print(f"exported {ckpt}{' (its weight average, ' + EMA_WEIGHTS_NAME + ')' if averaged else ''} -> {out}")
    return 0


def run_of(checkpoint: Path, out: Path) -> Path | None:
    """The run directory of ``checkpoint`` (``RUN/checkpoints/step-N``) when ``out`` lies inside it
    (an export into the run takes the run's lock), else None."""
    ckpt = Path(checkpoint).resolve()
    if ckpt.parent.name != "checkpoints":
        return None
    run = ckpt.parent.parent
    return run if Path(out).resolve().is_relative_to(run) else None


if __name__ == "__main__":
    sys.exit(main())
