"""MTP's training side: the :class:`MTPMethod` (the method's ``training_method``,
:mod:`draftsmith.methods`) and the dry run's estimates.

The target's own MTP layer (:mod:`.model`), warm-started from the target checkpoint
(``draft.init_from_target``, :func:`~.weights.read_target_mtp`), unrolled ``draft.ttt_steps``
times as vLLM reuses it for ``num_speculative_tokens`` > 1, and distilled against the target's
distribution over the full vocab with ``draft.loss`` (EAGLE-3's TTT rows and loss,
:func:`~draftsmith.models.eagle3.training.ttt_loss`, with the target's final normed hidden
state as the hidden input). The embedding and ``lm_head`` stay the target's (vLLM shares both).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from ...layout import DraftCheckpointConfig
from ...recipe import Recipe
from ...target import text_json
from ...train.dry_run import Shapes, head_estimate
from ...train.losses import LossSpec, TargetDraftHead
from ...train.method_base import MethodSetupError, TargetDataMethod
from ..common import LayerGeometry
from ..eagle3.training import eagle3_batch_plan, ttt_loss
from .config import MTPConfig, MTPTargetError, check_mtp_target
from .model import MTPDraftModel
from .weights import load_mtp_state, read_target_mtp

TRAIN_HELP = """Fine-tune the target's own multi-token-prediction (MTP) layer.

    accelerate launch -m draftsmith.train RECIPE.yaml --run-dir runs/x [--resume]
    draftsmith train RECIPE.yaml --run-dir runs/x

For targets that ship MTP layers (DeepSeek-V3 / R1: num_nextn_predict_layers; Qwen3-Next:
mtp_num_hidden_layers). Starts from the target checkpoint's MTP weights (draft.init_from_target),
reads the prepared final hidden states (or, online, runs the target), unrolls the layer
draft.ttt_steps times as vLLM does for num_speculative_tokens > 1 and distils each step against the
target's distribution (draft.loss). Export writes the target's config plus the MTP weights only;
serve with --speculative-config '{"method": "mtp", "model": EXPORT, "num_speculative_tokens": K}'.
"""


def read_target_config(target_dir: Path) -> dict[str, Any]:
    """The target's ``config.json`` (its text part for a multimodal wrapper)."""
    return text_json(json.loads((Path(target_dir) / "config.json").read_text()))


def mtp_config_of(target_config: dict[str, Any], where: str) -> MTPConfig:
    """The :class:`MTPConfig` of a target that ships MTP layers.

    Raises:
        MTPTargetError: the target ships none (one line, :func:`~.config.check_mtp_target`).
    """
    family, n = check_mtp_target(target_config, where)
    return MTPConfig(family.name, target_config, num_layers=n)


@torch.no_grad()
def init_random(model: MTPDraftModel, std: float = 0.02) -> MTPDraftModel:
    """A random start (``draft.init_from_target: false``, for ablations): every matrix
    N(0, ``std``), RMSNorm weights at identity (1, or 0 for Qwen3-Next's ``1 + w`` norms)."""
    zero_centred = model.config.family == "qwen3_next"
    for name, p in model.mtp.named_parameters():
        if "norm" in name:
            p.fill_(0.0 if zero_centred else 1.0)
        else:
            p.normal_(0.0, std)
    for name, b in model.mtp.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
    return model


class MTPMethod(TargetDataMethod):
    """The target's MTP layer, TTT-unrolled ``draft.ttt_steps`` times on the target's final
    hidden states, ``draft.loss`` against the target's full-vocab distribution.

    Raises:
        MethodSetupError: the target ships no MTP layer (one line naming the key and the family).
    """

    name = "mtp"
    help_text = TRAIN_HELP

    def __init__(self, recipe: Recipe, run_dir: Path):
        super().__init__(recipe, run_dir)
        self.check_target_vocab()
        try:
            self.config = mtp_config_of(read_target_config(self.target_dir), str(self.target_dir))
        except MTPTargetError as exc:  # one line before any step (the training commands exit 1)
            raise MethodSetupError(str(exc)) from None
        self.loss = LossSpec.from_recipe(recipe.draft)
        self.target_head = TargetDraftHead(self.heads["lm_head"], self.logit_softcap)  # the full vocab: MTP drafts over it

    def build_model(self) -> MTPDraftModel:
        """The MTP layer with the target's embedding and ``lm_head``; its weights the target's own
        (``draft.init_from_target``) or random.

        Raises:
            KeyError: the checkpoint holds no (or not every) MTP tensor the config declares.
        """
        model = MTPDraftModel(self.config)
        model.init_from_target(self.heads["embed_tokens"], self.heads["lm_head"])
        if self.recipe.draft.init_from_target:
            load_mtp_state(model, read_target_mtp(self.target_dir, self.config))
        else:
            init_random(model)
        return model

    def setup(self, accelerator: Any) -> None:
        super().setup(accelerator)
        self.target_head.to(accelerator.device)

    def batch_plan(self):
        """EAGLE-3's TTT rows per step, computed on the CPU batch in the DataLoader."""
        return functools.partial(eagle3_batch_plan, steps=self.recipe.draft.ttt_steps)

    def compute_loss(self, model, batch):
        """``sum_k gamma**k D_k`` over the TTT steps (:func:`~draftsmith.models.eagle3.training.ttt_loss`),
        the MTP layer reading the target's final hidden states. Metrics are device tensors."""
        from ...train.labels import ttt_prediction_masks
        from ..eagle3.training import ttt_plan

        _, final = self.target_states(batch)
        param = next(p for p in model.parameters() if p.requires_grad)
        K, docs = self.recipe.draft.ttt_steps, batch.get("document_ids")
        plan = batch if "ttt_index" in batch else ttt_plan(ttt_prediction_masks(batch["loss_mask"], K, docs))
        return ttt_loss(model, batch["input_ids"], final.to(param.dtype), final, plan, K, self.target_head,
                        self.recipe.draft.gamma, self.loss, self.recipe.train.loss_chunk_rows,
                        self.global_denominators, batch.get("position_ids"), docs,
                        fused=getattr(self.recipe.train, "fused_loss", None))

    def checkpoint_extras(self, directory: Path) -> None:
        DraftCheckpointConfig(method=self.name, config=self.config.to_dict(), target=self.target_info.to_dict(),
                              ttt_steps=self.recipe.draft.ttt_steps).write(directory)


# --------------------------------------------------------------------------------------
# The dry run's estimates


def mtp_parameter_count(target_config: dict[str, Any]) -> int:
    """Trainable parameters of the target's MTP layer (built on the meta device: exact, MoE included)."""
    cfg = mtp_config_of(target_config, "the target")
    with torch.device("meta"):
        model = MTPDraftModel(cfg)
    return sum(p.numel() for p in model.parameters())


def parameter_estimate(recipe: Recipe, geometry: LayerGeometry, vocab_size: int) -> tuple[dict[str, int], int]:
    """The MTP layer's parameters (from the target's ``config.json``, resolved as the dry run
    resolves it), the target's embedding and ``lm_head`` it holds frozen (``frozen_embedding``: both
    ``[V, H]``), and ``draft.ttt_steps`` steps of full-vocab logits
    (:func:`~draftsmith.train.dry_run.head_estimate`)."""
    from ...target import load_config_json

    config, _ = load_config_json(recipe, None)
    counts, logits = head_estimate({"mtp_layer": mtp_parameter_count(text_json(config))}, recipe.draft.ttt_steps,
                                   recipe, vocab_size)
    # the target's embedding and lm_head, each [V, H], held frozen beside the layer (MTPDraftModel's buffers)
    counts["frozen_embedding"] = 2 * vocab_size * geometry.hidden_size
    return counts, logits


def activation_estimate(recipe: Recipe, s: Shapes, trainable: int) -> dict[str, int]:
    """The step's activations, counted from the MTP decoder layer's own geometry (the target's
    ``config.json``), per TTT step k = 0..K-1 over the B*T tokens:

    - the layer's tensors kept for backward, per token: the fused input (``cat`` of two normed
      H-wide states, fp32) and its projection; the pre-attention and pre-MLP norms; q / k / v
      (MLA: also the q / kv latents, their norms and ``kv_b_proj``'s output), their roped copies,
      the attention output and ``o_proj``; the router logits and softmax; per routed expert slot
      (``num_experts_per_tok``) its gate / up / product and the gathered input and weighted output;
      the shared expert; the residual sums. Matmul outputs at the step's matmul width
      (``act_bytes``), norms and sums in fp32.
    - attention scores and probabilities, ``B * heads * T * (k+1)T`` fp32 each, where the q/k and v
      head widths differ (MLA's 192 vs 128): CUDA's fused SDPA kernels take neither that nor the
      unroll's mask, so the math path holds them (DeepSeek-V3: 24 GiB of the 29 GiB at B=1);
    - one loss chunk of full-vocab logits with its gradient.

    Within 10% of ``draftsmith bench memory`` on both MTP recipes (tests/integration/
    test_bench_memory_measured.py)."""
    from ...target import load_config_json
    from ...train.dry_run import loss_chunk_rows

    c = text_json(load_config_json(recipe, None)[0])
    K, A, F = recipe.draft.ttt_steps, s.act_bytes, 4
    H, nh = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V3 / Kimi)
        qk, vd, nkv = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"], nh
        latent = ((c.get("q_lora_rank") or 0) + c["kv_lora_rank"] + c["qk_rope_head_dim"]) * (A + F)
        extra = latent + nh * (c["qk_nope_head_dim"] + vd) * A
        experts, shared = c["n_routed_experts"], (c.get("n_shared_experts") or 0) * c["moe_intermediate_size"]
    else:  # Qwen3-Next: gated full attention (q_proj twice as wide)
        hd = c.get("head_dim") or H // nh
        qk = vd = hd
        nkv = c["num_key_value_heads"]
        extra = nh * hd * A
        experts, shared = c["num_experts"], c.get("shared_expert_intermediate_size") or 0
    top, inter = c["num_experts_per_tok"], c["moe_intermediate_size"]
    per_token = (5 * H * F + H * A + 4 * H * F + (nh * qk + nkv * qk + nkv * vd) * A + (nh + nkv) * qk * F
                 + nh * vd * A + H * A + H * F + extra + 2 * experts * F + top * (3 * inter * A + H * A + H * (A + F))
                 + ((3 * shared + H) * A if shared else 0) + H * F)
    scores = sum(s.B * nh * s.T * (k + 1) * s.T * F * 2 for k in range(K)) if qk != vd else 0
    return {"layer_activations": K * s.E * per_token, "attention_scores": scores,
            "loss_chunk": 2 * loss_chunk_rows(recipe, s.E, s.V) * s.V * 4}
