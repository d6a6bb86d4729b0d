"""Small EAGLE-3 TTT cases the loss tests share (tests/unit/test_accept_weighting.py,
tests/unit/test_opd.py): a tiny draft, a batch with holes and packed documents, and a stand-in
draft whose step logits are given tensors; a tiny DFlash case, and a tiny P-EAGLE step
(:func:`peagle_case`: tests/unit/test_accept_weighting_peagle.py, tests/unit/test_fused_loss.py)."""

from __future__ import annotations

import torch
from torch import nn

from helpers.tiny import dflash_tiny_config, eagle3_tiny_config, random_dflash_model


def tiny_eagle3(seed: int = 0, draft_vocab: int = 12):
    """A tiny EAGLE-3 draft over a 100-token target vocab (hidden 32), ``draft_vocab`` draft ids."""
    from draftsmith.models.eagle3.model import Eagle3DraftModel

    torch.manual_seed(seed)
    model = Eagle3DraftModel(eagle3_tiny_config(vocab_size=100, draft_vocab_size=draft_vocab))
    model.init_from_target(torch.randn(100, 32))
    return model


def ttt_batch(packed: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """B = 2, T = 24: prompt tokens untrained, a hole at (0, 11), row 1's tail untrained; with
    ``packed`` two documents in row 0 and padding (-1) in row 1."""
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 24
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :3] = 0
    mask[0, 11] = 0  # a hole: step k has no row where x_{t+k+2} is x_11, the later steps do
    mask[1, 20:] = 0
    batch = {"input_ids": torch.randint(0, 100, (B, T), generator=g), "loss_mask": mask,
             "aux_hidden_states": torch.randn(B, T, 96, generator=g), "final_hidden_states": torch.randn(B, T, 32, generator=g)}
    if packed:
        batch["document_ids"] = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    return batch


class FixedSteps(nn.Module):
    """A stand-in for the draft: step k's hidden state is a given ``(B, T, V)`` tensor (a leaf with
    grad), its logits the identity of it; calls ``step_head`` as the draft's forward does."""

    def __init__(self, hidden: list[torch.Tensor]):
        super().__init__()
        self.hidden = nn.ParameterList([nn.Parameter(h) for h in hidden])
        self.lm_head = nn.Linear(hidden[0].shape[-1], hidden[0].shape[-1], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(hidden[0].shape[-1]))
        self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids, aux, steps, loss_mask, position_ids, document_ids, step_head):
        return [step_head(k, self.hidden[k], self.lm_head) for k in range(steps)]


def dflash_case(seed: int = 0):
    """``(cfg, model, ids, aux, final, mask, head)``: a tiny DFlash draft (blocks of 5, a draft vocab of 3:
    the argmaxes agree often, blocks of mixed hits) and a batch with a hole inside a block."""
    from draftsmith.train.losses import TargetDraftHead

    cfg = dflash_tiny_config(block_size=5, draft_vocab_size=3)
    gen = torch.Generator().manual_seed(seed)
    B, T = 2, 16
    ids = torch.randint(10, cfg.vocab_size, (B, T), generator=gen)
    aux = torch.randn(B, T, 2 * cfg.target_hidden_size, generator=gen)
    final = torch.randn(B, T, cfg.hidden_size, generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :2] = 0
    mask[0, 8] = 0  # a hole: an untrained slot inside a block passes the chain on
    mask[1, 13:] = 0
    model = random_dflash_model(cfg, seed=1).train()
    head = TargetDraftHead(torch.randn(cfg.draft_vocab_size, cfg.hidden_size, generator=gen))
    return cfg, model, ids, aux, final, mask, head


@torch.no_grad()
def reference_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, accept) -> torch.Tensor:
    """Per row (last dim the vocab): ``sum min(p_T, q_T)`` for a soft AcceptSpec at T > 0, else the argmax hit."""
    if accept.soft:
        return torch.minimum(torch.softmax(target_logits / accept.temperature, -1),
                             torch.softmax(draft_logits / accept.temperature, -1)).sum(-1)
    return (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()


def peagle_case(seed: int = 1, packed: bool = True, num_depths: int = 4, draft_vocab: int = 3, **draft):
    """``(method, model, batch)``: a tiny P-EAGLE draft (a draft vocab of 3: the argmaxes agree often,
    COD chains of mixed length), a PEagleMethod without a run directory (the recipe fields its step
    reads, ``draft.accept_weighting`` / ``draft.opd`` and the served temperature set by ``draft``:
    ``accept_weighting``, ``opd``, ``opd_gamma``, ``temperature``, ``fused_loss``) and a batch of B = 2
    rows of T = 24 with untrained prompts, a hole and, with ``packed``, two documents and padding.
    The default seed's random draft cuts some hard chains before the deepest depth and keeps others
    (the accept-weighting tests check that they test both)."""
    from types import SimpleNamespace

    from draftsmith.models.peagle.config import PEagleConfig
    from draftsmith.models.peagle.model import PEagleDraftModel
    from draftsmith.models.peagle.training import PEagleMethod
    from draftsmith.train.losses import LossSpec, TargetDraftHead

    V, H, B, T = 64, 32, 2, 24
    cfg = PEagleConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       vocab_size=V, draft_vocab_size=draft_vocab, aux_layer_ids=[0, 1, 2], rope_theta=10000.0,
                       max_position_embeddings=256, num_layers=2, num_depths=num_depths, mask_token_id=3)
    torch.manual_seed(seed)
    model = PEagleDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.init_from_target(torch.randn(V, H))
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    method = PEagleMethod.__new__(PEagleMethod)
    method.recipe = SimpleNamespace(
        seed=seed, train=SimpleNamespace(fused_loss=draft.pop("fused_loss", False)),
        validation_temperatures=[draft.pop("temperature", 0.0)],
        draft=SimpleNamespace(num_depths=num_depths, down_sample_ratio=0.9, down_sample_ratio_min=0.2, max_anchors=None,
                              **{"accept_weighting": "none", "opd": "none", "opd_gamma": 0.8, **draft}))
    method.accelerator = SimpleNamespace(num_processes=1, process_index=0)
    method.target, method.config, method.loss = None, cfg, LossSpec()
    method.target_head = TargetDraftHead(3 * torch.randn(draft_vocab, H, generator=g))
    method._step, method._micro = 0, 0
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :4] = 0  # the prompts: the first chains start from untrained depth-0 elements
    mask[0, 13] = 0  # a hole: chains stop there
    batch = {"input_ids": torch.randint(4, V, (B, T), generator=g), "loss_mask": mask,
             "aux_hidden_states": torch.randn(B, T, 3 * H, generator=g),
             "final_hidden_states": torch.randn(B, T, H, generator=g)}
    if packed:
        batch["document_ids"] = torch.tensor([[0] * 10 + [1] * 14, [0] * 21 + [-1] * 3])
        batch["position_ids"] = torch.tensor([list(range(10)) + list(range(14)), list(range(21)) + [0] * 3])
        mask[0, 10:12] = 0  # the second document's prompt
        mask[1, 21:] = 0
    return method, model, batch


def host_reads_mode():
    """A ``TorchDispatchMode`` that records, in its ``seen`` list, every op that reads a tensor on the
    host (``.item()``, ``nonzero``, ``masked_select``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoSync(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return NoSync()
