"""The MLP speculator's training side: the :class:`MLPSpeculatorMethod` (the method's
``training_method``, :mod:`draftsmith.methods`) and the dry run's estimates.

IBM's MLP speculator (arXiv:2404.19124): P chained stages on the target's final
hidden state, stage-weighted cross-entropy (the heads' labels and loss are
:class:`~draftsmith.train.method_base.HeadMethod`'s, shared with Medusa); stage 2 trains on
sequences the target generates.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...target.capture import capture_batch
from ...recipe import Recipe
from ...train.dry_run import Shapes, fused_loss_bytes, head_estimate
from ...train.method_base import HeadMethod
from ..common import LayerGeometry
from .model import MLPSpeculator, MLPSpeculatorConfig


# the `draftsmith train RECIPE --help` description of this method
TRAIN_HELP = """Train an IBM MLP speculator (arXiv:2404.19124), stage 1 then optionally stage 2.

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume] [--set train.lr=1e-3]
    draftsmith train RECIPE.yaml --run-dir runs/x

Stage 1 trains on the prepared data (``RUN_DIR/data``: final hidden states from the shards,
or from the target in online mode) with teacher forcing: stage i at position t reads
x_{t+1+i} and predicts x_{t+2+i}. From optimizer step ``draft.stage2_start_step``
on (stage 2), each batch is replaced by sequences the frozen target generates itself: the
prompt part of each row (up to its first assistant token) is continued for
``stage2_new_tokens`` tokens (greedy, or sampled at ``stage2_temperature``), the target is run
on the result for its final normed hidden states, and the loss covers the generated tokens.
Per-stage cross-entropy weighted ``draft.head_decay**i``; metrics ``loss_{i}``, ``acc_{i}``.
"""


class MLPSpeculatorMethod(HeadMethod):
    """MLP speculator: P chained stages on the final hidden state and the teacher-forced
    tokens; the target is loaded in the job when stage 2 is configured."""

    name = "mlp_speculator"
    help_text = TRAIN_HELP

    def __init__(self, recipe: Recipe, run_dir: Path):
        cfg = recipe.draft
        super().__init__(recipe, run_dir, load_target_model=cfg.stage2_start_step is not None)
        H, V = self.check_target_vocab()
        self.config = MLPSpeculatorConfig(emb_dim=H, inner_dim=cfg.inner_dim or H, vocab_size=V,
                                          n_predict=cfg.n_predict, tie_weights=cfg.tie_weights,
                                          scale_input=cfg.scale_input)
        self.num_heads = cfg.n_predict
        self.step = 0

    def build_model(self) -> MLPSpeculator:
        return MLPSpeculator(self.config)

    def begin_step(self, step: int) -> None:
        self.step = step

    @property
    def in_stage2(self) -> bool:
        start = self.recipe.draft.stage2_start_step
        return start is not None and self.step >= start

    def head_forward(self, model: nn.Module, final: torch.Tensor, tokens: torch.Tensor, head_fn: Any) -> list[Any]:
        # row m is the length-1 sequence at position t: it needs x_t .. x_{t+P} (T + P = 1 + P)
        return model(final, tokens[:, : self.num_heads + 1], head_fn=head_fn)  # stage i's rows (M, D), head[i]

    def batch_states(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.in_stage2:
            return super().batch_states(batch)
        return self.generate_batch(batch)

    @torch.no_grad()
    def generate_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage 2: the target continues each sequence's prompt (a packed row's every document:
        :func:`sequences`); returns ``input_ids``, ``loss_mask`` (1 on generated tokens, up to and
        including end-of-sequence), ``attention_mask`` (right-padded, ``(S, P + N)`` for S sequences)
        and ``final_hidden_states (S, P + N, H)``: one unpacked row per sequence."""
        cfg = self.recipe.draft
        ids, mask, att = sequences(batch)
        B = ids.shape[0]
        # prompt = everything before the first assistant token (rows without one: the whole row)
        has_reply = mask.bool().any(1)
        prompt_len = torch.where(has_reply, mask.float().argmax(1).long(), att.sum(1)).tolist()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        P = max(prompt_len)
        # generate() wants left padding so that every row's continuation starts at column P
        prompts = ids.new_full((B, P), pad_id)
        prompt_att = torch.zeros_like(prompts)
        for b, n in enumerate(prompt_len):
            prompts[b, P - n :] = ids[b, :n]
            prompt_att[b, P - n :] = 1
        T = cfg.stage2_temperature
        # plain temperature sampling: top_k=0 / top_p=1 override the target's generation_config
        sampling = dict(do_sample=True, temperature=T, top_k=0, top_p=1.0) if T > 0 else dict(do_sample=False)
        out = self.target.generate(input_ids=prompts, attention_mask=prompt_att, max_new_tokens=cfg.stage2_new_tokens,
                                   pad_token_id=pad_id, **sampling)
        new = out[:, P:]  # (B, N)
        eos = self.target.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        rows = []
        for b, n in enumerate(prompt_len):
            gen = new[b].tolist()
            stop = next((j + 1 for j, t in enumerate(gen) if t in eos), len(gen))
            rows.append((ids[b, :n].tolist(), gen[:stop]))
        L = max(len(p) + len(g) for p, g in rows)
        seq = ids.new_full((B, L), pad_id)
        loss_mask = torch.zeros_like(seq)
        attention = torch.zeros_like(seq)
        for b, (p, g) in enumerate(rows):
            seq[b, : len(p) + len(g)] = torch.tensor(p + g, device=seq.device)
            loss_mask[b, len(p) : len(p) + len(g)] = 1
            attention[b, : len(p) + len(g)] = 1
        _, final = capture_batch(self.target, seq, attention, self.target_info.aux_layer_ids)
        self.generated_tokens = int(loss_mask.sum())
        return {"input_ids": seq, "loss_mask": loss_mask, "attention_mask": attention, "final_hidden_states": final}

    def compute_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """:meth:`HeadMethod.compute_loss` plus ``stage``. Stage 2 is the known exception to the
        no-host-read step: :meth:`generate_batch` runs ``generate`` and reads the generations
        back (and the generated batch has no plan, so its positions are gathered with a read)."""
        loss, metrics = super().compute_loss(model, batch)
        metrics["stage"] = 2.0 if self.in_stage2 else 1.0
        if self.in_stage2:
            metrics["stage2_generated_tokens"] = float(self.generated_tokens)
        return loss, metrics

    def draft_config(self) -> dict[str, Any]:
        return self.config.to_dict()


def sequences(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, loss_mask, attention_mask)`` with one row per sequence of ``batch``: its rows,
    or with ``document_ids`` (packed rows, ``train.packing``) each document of each row, in row
    order, right-padded. Reads the document ids on the host (stage 2 reads its generations anyway)."""
    docs = batch.get("document_ids")
    ids, mask, att = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    if docs is None:
        return ids, mask, att
    spans = []
    for b, row in enumerate(docs.tolist()):
        start = 0
        for j in range(1, len(row) + 1):
            if j == len(row) or row[j] != row[start]:
                if row[start] >= 0:
                    spans.append((b, start, j))
                start = j
    L = max(e - s for _, s, e in spans)
    out = [t.new_zeros((len(spans), L)) for t in (ids, mask, att)]
    for i, (b, s, e) in enumerate(spans):
        for o, t in zip(out, (ids, mask, att)):
            o[i, : e - s] = t[b, s:e]
    return out[0], out[1], out[2]


# --------------------------------------------------------------------------------------
# The dry run's estimates


def mlp_speculator_parameter_count(recipe: Recipe, hidden_size: int, vocab_size: int) -> dict[str, int]:
    """Trainable parameters of an MLP-speculator draft by part (full target vocab)."""
    H, V, m = hidden_size, vocab_size, recipe.draft
    D, P = m.inner_dim or H, m.n_predict
    stages = 1 if m.tie_weights else P  # tied: one emb/head/ln for all stages
    inner_projs = min(P - 1, 1) if m.tie_weights else P - 1  # tied: stages >= 1 share one proj
    return {"emb": stages * V * D, "proj": H * D + inner_projs * D * D, "head": stages * V * D, "ln": stages * 2 * D}


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """The MLP speculator's parameter counts by part (:func:`mlp_speculator_parameter_count`;
    ``geometry`` gives the hidden size) and the logits estimate of its stages
    (:func:`~draftsmith.train.dry_run.head_estimate`)."""
    counts = mlp_speculator_parameter_count(recipe, geometry.hidden_size, vocab_size)
    return head_estimate(counts, recipe.draft.n_predict, recipe, vocab_size)


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """MLP speculator: P stages over the M = B*T gathered rows (inner width D), each with a
    token embedding and a full-vocab head. The peak is in backward at the embeddings: their
    dense fp32 ``(V, D)`` gradients (tied weights: every stage's, summed: about 3.5 fp32 tables),
    plus the rows' stage tensors (about 22 B per unit of D)."""
    D = recipe.draft.inner_dim or s.H
    tables = 14 * s.V * D if recipe.draft.tie_weights else 6 * s.V * D
    # the fused loss (GPU): the heads' gradients, computed in forward, are held into backward
    fused = fused_loss_bytes(recipe, replace(s, H=D), s.E, recipe.draft.n_predict, s.V, labels=True) or {}
    held = {"fused_loss_gradients": fused["fused_loss_gradients"]} if fused else {}
    backward = {"embedding_gradients": tables, "rows": 22 * s.E * D, "input_cast": 0, **held}
    forward = {"rows": 22 * s.E * D, "input_cast": 0, **fused}
    return forward if sum(forward.values()) > sum(backward.values()) else backward
