"""Simulated acceptance length of an EAGLE-3 draft on prepared data, without vLLM.

    draftsmith simulate --draft DRAFT --data RUN_DIR/data [--k 3] [--temperatures 0,0.7] [--out sim.json]

``DRAFT`` is an export folder (speculators format, ours or a published draft) or a draftsmith
checkpoint (``checkpoints/step-N``, ``checkpoints/best``); ``RUN_DIR/data`` a prepared data
folder (hidden-state shards, ``draftsmith prepare``) of the same target at the draft's aux layer
ids. Every sequence of the data is evaluated exactly as training validates
(:mod:`draftsmith.train.validation`): the TTT forward over the target's hidden states, and the
chain rule of vLLM's rejection sampler against the target's full-vocab distribution (T=0: argmax
agreement; T>0: expected acceptance, greedy drafts as vLLM's EAGLE proposer makes them).

Prepared from the prompts an acceptance run uses, with the target's greedy replies of the same
length (``data.regenerate.max_new_tokens``), the data holds the very tokens vLLM generates at
T=0, so the simulation and vLLM's measured acceptance length see the same text: issue 17's
check of the simulation (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def simulate(draft: Path, data_dir: Path, k: int = 3, temperatures: tuple[float, ...] = (0.0,),
             batch_size: int = 8, draft_sampling: str = "greedy") -> dict[str, Any]:
    """Validation metrics (``val_sim_al``, ``val_sim_rate_k``, ``val_loss_k``, ``val_acc_k``, ...)
    of ``draft`` over every sequence of ``data_dir``.

    ``data_dir`` may also be the run directory holding it (``RUN_DIR``). Errors name ``draft``
    and ``data_dir`` as given (never the temporary run directory the evaluation reads them
    through, nor the ``draft.init_from`` key it loads the draft with).

    Raises:
        WarmStartError: the draft is missing, unreadable or does not fit the data's target / aux
            layer ids.
        FileNotFoundError / ShardError: ``data_dir`` is not a prepared data folder.
    """
    import tempfile

    import torch
    from accelerate import Accelerator

    from ..layout import DRAFT_CONFIG_FILE
    from ..recipe import load_recipe
    from ..train.data import collate
    from ..train.method_eagle3 import Eagle3Method
    from ..train.validation import run_validation, validation_batches
    from ..train.warm_start import WarmStartError

    given = data_dir
    if not Path(draft).is_dir():
        raise WarmStartError(f"--draft {draft}: no such directory; pass an export (draftsmith export) or a "
                             "checkpoint (RUN_DIR/checkpoints/step-N)")
    if not any((Path(draft) / name).is_file() for name in ("config.json", DRAFT_CONFIG_FILE)):
        raise WarmStartError(f"--draft {draft}: neither an export (no config.json) nor a checkpoint (no "
                             f"{DRAFT_CONFIG_FILE}); pass an export (draftsmith export) or a checkpoint "
                             "(RUN_DIR/checkpoints/step-N)")
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data {data_dir}: no such directory; pass the RUN_DIR/data folder "
                                "`draftsmith prepare RECIPE --run-dir RUN_DIR` wrote")
    if not (Path(data_dir) / "target.json").is_file() and (Path(data_dir) / "data" / "target.json").is_file():
        data_dir = Path(data_dir) / "data"  # the run directory: its data folder
    if not (Path(data_dir) / "target.json").is_file():
        raise FileNotFoundError(f"--data {given}: not a prepared data folder (no target.json); pass the "
                                "RUN_DIR/data folder `draftsmith prepare RECIPE --run-dir RUN_DIR` wrote")
    data_dir = Path(data_dir).resolve()
    overrides = [f"draft.init_from={draft}", f"eval.num_speculative_tokens={k}",
                 f"train.eval_temperatures={list(temperatures)}", f"train.eval_draft_sampling={draft_sampling}",
                 f"draft.ttt_steps={k}", "data.hidden_states_mode=offline"]
    recipe = load_recipe(None, overrides)
    with tempfile.TemporaryDirectory(prefix="draftsmith-sim-") as tmp:
        (Path(tmp) / "data").symlink_to(data_dir)
        try:
            method = Eagle3Method(recipe, Path(tmp), vocab_from_init=True)
            model = method.build_model()
            acc = Accelerator(cpu=not torch.cuda.is_available())
            model = model.to(acc.device)
            method.setup(acc)
            dataset = method.dataset()
            batches = validation_batches(dataset, batch_size, collate, 1, 0)
            out = run_validation(method, model, batches, acc)
        except (WarmStartError, FileNotFoundError, RuntimeError, ValueError) as exc:
            # the data is read through tmp/data and the draft as draft.init_from: name what was given
            text = str(exc).replace(str(Path(tmp) / "data"), str(data_dir)).replace(str(Path(tmp)), str(data_dir))
            text = (text.replace("draft.init_from: ", f"--draft {draft}: ").replace("draft.init_from=", "--draft ")
                    .replace(" does not fit this run ", f" does not fit the data {data_dir} "))
            if text == str(exc):
                raise
            try:
                renamed = type(exc)(text)
            except Exception:  # an exception class that takes other arguments: keep it as it is
                raise exc from None
            raise renamed from None
    out.update(draft=str(draft), data=str(data_dir), num_sequences=len(dataset), k=k,
               temperatures=list(temperatures), draft_sampling=draft_sampling)
    return out


def temperature_list(text: str) -> tuple[float, ...]:
    """``--temperatures``: comma-separated numbers >= 0 (argparse reports a bad one, exit 2)."""
    temps = []
    for item in text.split(","):
        try:
            t = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} in {text!r} is not a number; give comma-separated "
                                             "temperatures, e.g. --temperatures 0,0.7") from None
        if not t >= 0:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} in {text!r}: a temperature must be >= 0, "
                                             "e.g. --temperatures 0,0.7")
        temps.append(t)
    return tuple(temps)


def build_parser() -> argparse.ArgumentParser:
    from ..cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--draft", type=Path, required=True, help="EAGLE-3 export folder or draftsmith checkpoint")
    p.add_argument("--data", type=Path, required=True, help="prepared RUN_DIR/data folder (hidden-state shards)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per chain (num_speculative_tokens)")
    p.add_argument("--temperatures", default="0", type=temperature_list,
                   help="comma-separated sampling temperatures simulated, each >= 0 (e.g. 0,0.7)")
    p.add_argument("--draft-sampling", default="greedy", choices=["greedy", "sample"],
                   help="T > 0: greedy drafts (vLLM's EAGLE proposer) or drafts sampled from the draft")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--out", type=Path, help="write the metrics as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    from ..data_prep.shards import ShardError
    from ..train.warm_start import WarmStartError

    args = build_parser().parse_args(argv)
    temps = args.temperatures
    try:
        out = simulate(args.draft, args.data, args.k, temps, args.batch_size, args.draft_sampling)
    except (WarmStartError, ShardError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rates = "/".join(f"{out[f'val_sim_rate_{k}']:.3f}" for k in range(args.k))
    line = f"simulated AL {out['val_sim_al']:.3f} (per position {rates})"
    for t in temps:
        if t:
            line += f", T={t:g}: {out[f'val_sim_al_t{t:g}']:.3f}"
    print(f"{line}; {out['num_sequences']} sequences, {int(out['val_chains'])} chains")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
