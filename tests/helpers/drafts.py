"""Random drafts of every method on a (tiny) target and their reference proposers: what the
speculative decoding tests verify against the target."""

from __future__ import annotations

import torch

from draftsmith.models.eagle3.proposer import Eagle3Proposer
from draftsmith.models.medusa.proposer import MedusaProposer
from draftsmith.models.mlp_speculator.proposer import MLPSpeculatorProposer
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.medusa.model import MedusaConfig, MedusaModel
from draftsmith.models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig


def draft_vocab(vocab_size: int, draft_vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random draft vocab: ``d2t`` offsets (target id = i + d2t[i]) and ``t2d``."""
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size), t2d


def make_eagle3(model, draft_vocab_size: int, aux_layer_ids: list[int], seed: int = 0) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    draft = Eagle3DraftModel(Eagle3Config.from_target(model.config, draft_vocab_size, aux_layer_ids))
    draft.init_from_target(model.get_input_embeddings().weight.detach())
    draft.set_vocab_mapping(*draft_vocab(model.config.vocab_size, draft_vocab_size, seed))
    return draft.eval()


def make_medusa(model, num_heads: int = 3, seed: int = 0) -> MedusaModel:
    torch.manual_seed(seed)
    medusa = MedusaModel(MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                                      num_heads=num_heads))
    with torch.no_grad():  # fresh ResBlocks are zero (identity): randomise them too
        for p in medusa.parameters():
            p.normal_(0, 0.2)
    return medusa.eval()


def make_mlp(model, n_predict: int = 3, seed: int = 0) -> MLPSpeculator:
    torch.manual_seed(seed)
    H = model.config.hidden_size
    return MLPSpeculator(MLPSpeculatorConfig(emb_dim=H, inner_dim=H, vocab_size=model.config.vocab_size,
                                             n_predict=n_predict)).eval()


def random_proposer(kind: str, model, aux_layer_ids: list[int], draft_vocab_size: int, seed: int = 0):
    if kind == "eagle3":
        return Eagle3Proposer(make_eagle3(model, draft_vocab_size, aux_layer_ids, seed))
    if kind == "medusa":
        return MedusaProposer(make_medusa(model, seed=seed))
    return MLPSpeculatorProposer(make_mlp(model, seed=seed))


def strengthen_attention(model, value_scale: float = 2.0, query_scale: float = 5.0) -> None:
    """Make a random Llama's output depend on its context: at init its residual stream is
    dominated by the token embedding, so a corrupted KV cache (a rejected draft left in it,
    shifted positions) would go unnoticed. Measured on the tiny target: changing one prompt
    token changes 16% of the next 10 greedy tokens before, 44% after; outputs stay varied."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj, scale in (("v_proj", value_scale), ("o_proj", value_scale), ("q_proj", query_scale),
                                ("k_proj", query_scale)):
                getattr(layer.self_attn, proj).weight.mul_(scale)
