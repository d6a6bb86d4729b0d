"""Medusa-1 heads (Cai et al., arXiv:2401.10774) in the layout vLLM (<= 0.32) loads.

Each of K heads reads the target's final *normed* hidden state ``h_t`` (the target
``lm_head`` input) and predicts a token further ahead than the target's own next token:

    ResBlock(h) = h + SiLU(Linear(H, H, bias)(h))     # weight and bias zero-initialised
    logits_k    = Linear(H, V, bias=False)(ResBlock^n(h_t))   # head k predicts x_{t+k+2}

(x_{t+1} comes from the target's ``lm_head``.) Submodule names give vLLM's weight names
``blocks.{k}.layers.{l}.weight|bias`` and ``lm_heads.{k}.weight`` (docs/formats.md, "Medusa and MLP speculator").

Shapes: B batch, T sequence length (tokens), H target hidden size, V target vocab size,
K number of heads.

Training passes ``head_fn`` to :meth:`MedusaModel.forward`: each head's pre-logit rows and
``lm_heads[k]`` go to it instead of being projected, so the loss is computed (in chunks of
rows) inside the model's forward and no ``(K, B, T, V)`` tensor is built.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

HeadFn = Callable[[int, torch.Tensor, nn.Module], Any]
"""``head_fn(k, hidden (N, H), lm_head_k) -> result``: what training does with head k's
pre-logit rows (``N = B * T``) and its ``lm_head`` (e.g. a chunked cross-entropy)."""


@dataclass
class MedusaConfig:
    """Architecture of a set of Medusa heads for one target.

    Attributes:
        hidden_size: H, the target's hidden size.
        vocab_size: V, the target's vocabulary size (Medusa has no draft vocab).
        num_heads: K; head k predicts x_{t+k+2}.
        num_layers: ResBlocks per head (Medusa-1: 1).
    """

    hidden_size: int
    vocab_size: int
    num_heads: int = 3
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1, got {self.num_heads}, {self.num_layers}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MedusaBlock(nn.Module):
    """``n`` residual blocks ``h + SiLU(W h + b)``; ``layers.{l}`` is vLLM's naming."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        H = config.hidden_size
        self.layers = nn.ModuleList([nn.Linear(H, H, bias=True) for _ in range(config.num_layers)])
        for layer in self.layers:
            # zero weight *and* bias: a fresh block is the identity, so a fresh head starts as
            # the target's lm_head (when copied in) instead of a perturbed copy of it
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + F.silu(layer(h))  # (..., H)
        return h


class MedusaModel(nn.Module):
    """K Medusa heads. ``forward(hidden_states (B, T, H)) -> logits (K, B, T, V)``."""

    _no_split_modules = ["MedusaBlock"]  # FSDP unit (transformers convention, read by accelerate)

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList([MedusaBlock(config) for _ in range(config.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(H, V, bias=False) for _ in range(config.num_heads)])

    @torch.no_grad()
    def init_from_target(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target ``lm_head`` ``(V, H)`` into every head (Medusa's initialisation).

        Raises:
            ValueError: the weight is not ``(V, H)``.
        """
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head_weight.shape) != want:
            raise ValueError(f"target lm_head has shape {tuple(lm_head_weight.shape)}, the heads need {want}")
        for head in self.lm_heads:
            head.weight.copy_(lm_head_weight.to(head.weight.dtype))

    def forward(self, hidden_states: torch.Tensor, head_fn: HeadFn | None = None) -> torch.Tensor | list[Any]:
        """Logits of every head: ``(K, B, T, V)``; ``[k, :, t]`` is the distribution of x_{t+k+2}.

        Args:
            hidden_states: ``(B, T, H)`` the target's final normed hidden states.
            head_fn: training: called as ``head_fn(k, rows (B*T, H), lm_heads[k])`` with head k's
                pre-logit rows instead of projecting them (:data:`HeadFn`); forward then returns
                the K results as a list and builds no logits.
        """
        if head_fn is None:
            return torch.stack([head(block(hidden_states)) for block, head in zip(self.blocks, self.lm_heads)])
        return [head_fn(k, block(hidden_states).flatten(0, -2), head)
                for k, (block, head) in enumerate(zip(self.blocks, self.lm_heads))]
