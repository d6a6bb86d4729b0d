"""Train an EAGLE-3 draft with training-time test.

    accelerate launch train/eagle3.py RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=3e-4]
    python train/eagle3.py RECIPE.yaml --run-dir runs/x

Reads ``RUN_DIR/data`` (written by ``data_prep/prepare.py``): target info, draft vocab and
hidden-state shards. Writes checkpoints under ``RUN_DIR/checkpoints`` and metrics to
``RUN_DIR/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.data_prep.prepare import DataPaths, read_vocab
from draftsmith.data_prep.hidden_states import HiddenStateDataset, TokenizedDataset, capture_batch
from draftsmith.data_prep.target import load_target, load_target_head_tensors
from draftsmith.models.eagle3 import Eagle3Config, Eagle3DraftModel, ttt_prediction_mask
from draftsmith.recipe import Recipe, add_recipe_arguments, recipe_from_args
from draftsmith.train.losses import TargetDraftHead, ttt_loss
from draftsmith.train.trainer import fit

log = logging.getLogger("draftsmith.train.eagle3")


class Eagle3Method:
    """EAGLE-3: fused aux states in, TTT unrolled ``train.ttt_steps`` times, forward-KL loss
    against the target distribution over the draft vocab."""

    name = "eagle3"

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        self.recipe, self.paths = recipe, DataPaths(run_dir / "data")
        if not self.paths.target_info.is_file():
            raise FileNotFoundError(f"{self.paths.target_info} missing: run data_prep/prepare.py first")
        self.target_info = json.loads(self.paths.target_info.read_text())
        target_dir = Path(self.target_info["path"])
        self.d2t, self.t2d = read_vocab(self.paths)
        self.config = Eagle3Config.from_target(
            AutoConfig.from_pretrained(target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]),
            aux_layer_ids=self.target_info["aux_layer_ids"],
            norm_before_residual=recipe.draft.norm_before_residual,
        )
        heads = load_target_head_tensors(target_dir)
        if heads["lm_head"].shape[0] != self.t2d.shape[0]:
            raise ValueError(
                f"{self.paths.vocab}: t2d covers {self.t2d.shape[0]} target ids but the target lm_head has "
                f"{heads['lm_head'].shape[0]} rows (vocab built for another target?)"
            )
        self.heads = heads
        self.target_head = TargetDraftHead.from_full(heads["lm_head"].float(), self.t2d)
        self.target = None
        if recipe.data.hidden_states_mode == "online":
            # frozen target in the same job; its states never touch the disk
            self.target, _ = load_target(target_dir, getattr(torch, recipe.target.dtype),
                                         recipe.target.trust_remote_code)

    def dataset(self) -> torch.utils.data.Dataset:
        if self.target is not None:
            return TokenizedDataset(self.paths.tokenized, self.recipe.data.max_length)
        return HiddenStateDataset(self.paths.hidden_states, max_length=self.recipe.data.max_length)

    def build_model(self) -> Eagle3DraftModel:
        model = Eagle3DraftModel(self.config)
        init = self.recipe.draft.init_lm_head_from_target
        model.init_from_target(
            self.heads["embed_tokens"].float(),
            self.target_head.weight if init else None,
            self.heads["final_norm"].float() if init else None,
        )
        model.set_vocab_mapping(self.d2t, self.t2d)
        return model

    def setup(self, accelerator) -> None:
        self.accelerator = accelerator
        self.target_head.to(accelerator.device)
        if self.target is not None:
            self.target.to(accelerator.device)

    def target_states(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux (B, T, 3H), final (B, T, H))``: from the shards, or from the target (online)."""
        if "aux_hidden_states" in batch:
            return batch["aux_hidden_states"], batch["final_hidden_states"]
        return capture_batch(self.target, batch["input_ids"], batch["attention_mask"],
                             self.target_info["aux_layer_ids"])

    def compute_loss(self, model, batch):
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.target_states(batch)
        aux = aux.to(param.dtype)  # (B, T, 3H)
        target_logits = self.target_head(final)  # (B, T, Vd), fp32
        K = self.recipe.train.ttt_steps
        step_logits = model(batch["input_ids"], aux, K, batch["loss_mask"])
        denominators = None
        world = self.accelerator.num_processes
        if world > 1:  # normalise by the global token count (see ttt_loss)
            counts = torch.stack([ttt_prediction_mask(batch["loss_mask"], k).sum() for k in range(K)]).float()
            denominators = (self.accelerator.reduce(counts, reduction="sum") / world).clamp_min(1.0).tolist()
        loss, m = ttt_loss(step_logits, target_logits, batch["loss_mask"], self.recipe.train.gamma, denominators)
        global_loss = self.accelerator.reduce(loss.detach(), reduction="mean") if world > 1 else loss.detach()
        metrics = {"loss": float(global_loss)}
        for k, (lk, ak) in enumerate(zip(m.loss, m.acc)):
            metrics[f"loss_{k}"] = lk
            metrics[f"acc_{k}"] = ak
        return loss, metrics

    def checkpoint_extras(self, directory: Path) -> None:
        (directory / "draft_config.json").write_text(json.dumps(
            {"method": self.name, "config": self.config.to_dict(), "target": self.target_info,
             "ttt_steps": self.recipe.train.ttt_steps}, indent=1))
        save_file({"d2t": self.d2t, "t2d": self.t2d}, str(directory / "vocab.safetensors"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--run-dir", type=Path, help="run directory (required unless --dry-run)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in RUN_DIR")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe and print size estimates; no weights")
    p.add_argument("--target-config", type=Path, help="with --dry-run: the target's config.json (no hub access)")
    args = p.parse_args(argv)
    recipe = recipe_from_args(args)
    if args.dry_run:
        from draftsmith.train.dry_run import dry_run, format_report

        try:
            print(format_report(dry_run(recipe, args.target_config)))
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.run_dir is None:
        p.error("--run-dir is required")
    result = fit(recipe, Eagle3Method(recipe, args.run_dir), args.run_dir, resume=args.resume,
                 argv=sys.argv if argv is None else argv)
    print(json.dumps({"steps": result.steps, "tokens": result.tokens, "seconds": round(result.seconds, 1),
                      "tokens_per_s": round(result.tokens_per_s, 1), "checkpoint": str(result.checkpoint),
                      "metrics": result.last_metrics}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
