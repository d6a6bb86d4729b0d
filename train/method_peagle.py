"""The :class:`PEagleMethod` that ``train/peagle.py`` runs (``draftsmith.methods`` names it).

P-EAGLE (arXiv:2602.01469; docs/parallel_drafts.md, "P-EAGLE: conditional-drop (COD) elements"):
the EAGLE-3 data (aux states,
draft vocab, loss mask) on the EAGLE-shifted sequence, conditional-drop (COD) sampling of mask
chains re-drawn every micro-batch on the batch's device (:func:`~draftsmith.train.labels.cod_sample`,
a generator seeded from ``(seed, step, micro-batch, rank)``), one forward over all sampled
elements, the divergence ``draft.loss`` (default forward KL) to the target over the draft vocab
at ``anchor + depth`` (no depth decay, depth 0 included), computed inside the model's forward in
chunks of rows. No TTT: vLLM never feeds draft states back. The step reads nothing on the host:
its metrics are detached device tensors (:func:`~draftsmith.train.losses.cod_loss`).

Packed rows (``train.packing``): chains, attention and labels stay in their document; the COD
budgets (``draft.max_anchors``, the per-depth counts) are per row, shared by its documents.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from ..models.common import DistillTargets
from ..models.eagle3.config import Eagle3Config
from ..models.peagle.config import PEagleConfig
from ..models.peagle.model import CODElements, PEagleDraftModel
from ..recipe import Recipe
from .labels import cod_sample, cod_targets, step0_prediction_mask
from .losses import chunked_distill, cod_loss
from .method_base import DraftVocabMethod

log = logging.getLogger("draftsmith.train.peagle")


def cod_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """The COD generator seed of one micro-batch: a hash of ``(seed, step, micro_batch, rank)``
    (63 bits), so a resumed run draws the same elements and ranks / micro-batches differ."""
    digest = hashlib.blake2b(f"{seed}/{step}/{micro_batch}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class CODPlan:
    """The P-EAGLE ``batch_plan``: host-side numbers of the collated CPU batch (DataLoader
    workers), so that the step sizes its tensors without reading the device.

    Adds ``cod_seed_bound`` (python int: the most trained positions in a row, which sizes the
    COD depth budgets, :func:`~draftsmith.train.labels.cod_budget`) and ``cod_rows0``
    (``(N0,)`` int64 CPU tensor: ``b * T + i`` of the trained depth-0 positions, so the loss
    projects only those depth-0 elements and every depth >= 1 slot).
    """

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, object]:
        pred = step0_prediction_mask(batch["loss_mask"], batch.get("document_ids"))
        return {"cod_seed_bound": int(pred.sum(1).max()) if pred.numel() else 0,
                "cod_rows0": torch.nonzero(pred.reshape(-1)).flatten()}


class PEagleMethod(DraftVocabMethod):
    """P-EAGLE: COD chains of mask slots on the EAGLE-3 data, forward-KL loss."""

    name = "peagle"

    def __init__(self, recipe: Recipe, run_dir: Path):
        from transformers import AutoConfig

        super().__init__(recipe, run_dir)
        draft = recipe.draft
        base = Eagle3Config.from_target(
            AutoConfig.from_pretrained(self.target_dir, trust_remote_code=recipe.target.trust_remote_code),
            draft_vocab_size=int(self.d2t.shape[0]), aux_layer_ids=self.target_info["aux_layer_ids"],
            norm_before_residual=draft.norm_before_residual)
        mask_id = self.mask_token_id()
        log.info("P-EAGLE mask token id %d (never occurs in %s)", mask_id, self.paths.tokenized)
        self.config = PEagleConfig.from_eagle3(base, num_layers=draft.num_layers, num_depths=draft.num_depths,
                                               mask_token_id=mask_id, train_embeddings=draft.train_embeddings)
        self._step, self._micro = 0, 0

    def build_model(self) -> PEagleDraftModel:
        torch.manual_seed(self.recipe.seed)  # mask_hidden's randn init
        return self.init_draft(PEagleDraftModel(self.config))  # init_draft sets train.attention_backend

    def begin_step(self, step: int) -> None:
        """COD samples are re-drawn every micro-batch from a generator on the batch's device
        seeded with :func:`cod_seed` of ``(seed, step, micro-batch, rank)``: a resumed run draws
        the same elements. The trainer calls this before every micro-batch: the count restarts
        only when the step changes."""
        if step != self._step:
            self._step, self._micro = step, 0

    def cod_generator(self, device: torch.device) -> torch.Generator:
        """The next micro-batch's COD generator (host-side seed, no sync)."""
        rank = getattr(self.accelerator, "process_index", 0) if self.accelerator is not None else 0
        seed = cod_seed(self.recipe.seed, self._step, self._micro, rank)
        self._micro += 1
        return torch.Generator(device=device).manual_seed(seed)

    def batch_plan(self) -> CODPlan:
        return CODPlan()

    def sample(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, CODElements]:
        """``(prediction mask (B, T), COD elements)`` of a batch (the next micro-batch's draw);
        the depth budgets come from the plan's ``cod_seed_bound`` when the batch has one, else T."""
        docs = batch.get("document_ids")
        pred = step0_prediction_mask(batch["loss_mask"], docs)  # (B, T): position i predicts x_{i+2}
        d = self.recipe.draft
        elements = cod_sample(pred, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min,
                              self.cod_generator(pred.device), d.max_anchors, docs, batch.get("cod_seed_bound"))
        return pred, elements

    def denominator(self, count: torch.Tensor) -> torch.Tensor:
        """The loss normaliser of ``count`` trained elements (0-dim device tensor): the local
        count, or the data-parallel :meth:`global_denominators`; at least 1."""
        den = self.global_denominators(count.view(1))
        if den is None:
            return count.float().clamp_min(1.0)
        return torch.as_tensor(den, dtype=torch.float32, device=count.device).reshape(-1)[0]

    def compute_loss(self, model, batch):
        aux, final = self.training_states(model, batch)  # (B, T, 3H)
        pred, elements = self.sample(batch)
        sel = cod_targets(elements, pred)  # (B, S) trained elements
        B, T = pred.shape
        # the teacher of position i is the target's distribution of x_{i+2}: its row at i + 1,
        # computed once at positions 1..T-1 and indexed (position T-1 is never trained)
        shifted = final[:, 1:] if T > 1 else final  # a view
        teacher = self.target_head(shifted).reshape(-1, self.target_head.weight.shape[0])  # (B * (T-1), Vd)
        per_row = shifted.shape[1]
        index = elements.pos.clamp_max(per_row - 1) + per_row * torch.arange(B, device=pred.device).unsqueeze(1)
        weight = (sel.float() / self.denominator(sel.sum())).reshape(-1)
        index, depth, sel = index.reshape(-1), elements.depth.reshape(-1), sel.reshape(-1)
        train_rows = None
        if "cod_rows0" in batch:  # the plan's trained depth-0 positions, then every deeper slot
            S = elements.anchor.shape[1]
            r0 = batch["cod_rows0"]
            deeper = torch.arange(T, S, device=pred.device) + S * torch.arange(B, device=pred.device).unsqueeze(1)
            train_rows = torch.cat([r0 // T * S + r0 % T, deeper.reshape(-1)])
            index, weight, depth, sel = (t.index_select(0, train_rows) for t in (index, weight, depth, sel))
        out = model(batch["input_ids"], aux, elements, batch.get("position_ids"), batch.get("document_ids"),
                    targets=DistillTargets(teacher, index, weight, chunked_distill, self.loss, rows=train_rows))
        return cod_loss(out, depth, sel, self.recipe.draft.num_depths)
