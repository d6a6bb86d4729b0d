"""IBM's MLP speculator (Wertheimer et al., arXiv:2404.19124; fms-extras ``MLPSpeculator``).

A chain of ``n_predict`` small MLP stages. Stage 0 reads the target's final normed hidden
state at position t; stage i > 0 reads stage i-1's state. Each stage also reads the
embedding of the token just before the one it predicts:

    s = proj[i](s)                                   # Linear(D_in -> inner), no bias
    s = s + (emb_w / state_w) * emb[i](x_{t+1+i})    # token embedding, inner wide
    s = GELU(ln[i](s))                               # ln: RMS-style norm with weight and bias
    logits_i = head[i](s)                            # Linear(inner -> V), predicts x_{t+2+i}

with ``state_w = 0.5 ** (0.5 / n_predict)`` and ``emb_w = sqrt((1 - state_w**2) * inner / 2)``
(the state keeps ~half of its magnitude by the last stage). ``scale_input`` normalises the
target state first (an RMS norm without parameters, divided by sqrt(2)); ``tie_weights``
shares ``emb``, ``head``, ``ln`` across all stages and ``proj`` across stages >= 1 (stage 0's
projection reads the target width), as fms-extras does.

Submodule names ``emb.{i}``, ``proj.{i}``, ``head.{i}``, ``ln.{i}`` give the checkpoint names
``speculator.{emb,proj,head,ln}.{i}.weight`` / ``speculator.ln.{i}.bias`` once prefixed with
``speculator.`` (done at export, docs/formats.md, "Medusa and MLP speculator").

Shapes: B batch, T positions, H target hidden size (= emb_dim), D inner_dim, V vocab size,
P n_predict.

Training passes ``head_fn`` to :meth:`MLPSpeculator.forward`: each stage's state rows and
``head[i]`` go to it instead of being projected, so the loss is computed (in chunks of rows)
inside the model's forward and no ``(P, B, T, V)`` tensor is built.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

HeadFn = Callable[[int, torch.Tensor, nn.Module], Any]
"""``head_fn(i, state (N, D), head_i) -> result``: what training does with stage i's state rows
(``N = B * T``, the input of ``head[i]``) and its head (e.g. a chunked cross-entropy)."""


@dataclass
class MLPSpeculatorConfig:
    """Architecture of an MLP speculator for one target.

    Attributes:
        emb_dim: the target's hidden size H (width of the state stage 0 reads).
        inner_dim: D, the width of every stage's state and token embedding (0 = emb_dim).
        vocab_size: V, the target's vocabulary size.
        n_predict: P, stages = tokens proposed per step.
        tie_weights: share emb/head/ln across stages and proj across stages >= 1.
        scale_input: normalise the target state before stage 0.
    """

    emb_dim: int
    inner_dim: int
    vocab_size: int
    n_predict: int = 3
    tie_weights: bool = False
    scale_input: bool = False

    def __post_init__(self) -> None:
        if self.inner_dim == 0:
            self.inner_dim = self.emb_dim
        if self.n_predict < 1:
            raise ValueError(f"n_predict must be >= 1, got {self.n_predict}")
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("tie_weights needs n_predict >= 2 (there is nothing to tie with one stage)")

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight**2) * (self.inner_dim / 2))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MLPSpeculatorLayerNorm(nn.Module):
    """RMS-style norm ``x / rms(x) * weight + bias`` (fms-extras ``LayerNormParameterized``
    with ``use_mean=False``); without ``affine`` no parameters (the ``scale_input`` norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """``forward(state (B, T, H), input_ids (B, T + P)) -> logits (P, B, T, V)`` (teacher
    forcing); :meth:`stage` runs one stage (what a decoder calls step by step)."""

    # No FSDP unit below the root: no module holds one stage, and tie_weights shares tensors across stages.
    _no_split_modules: list[str] = []

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__()
        self.config = config
        H, D, V, P = config.emb_dim, config.inner_dim, config.vocab_size, config.n_predict
        self.emb = nn.ModuleList([nn.Embedding(V, D) for _ in range(P)])
        self.proj = nn.ModuleList([nn.Linear(H if i == 0 else D, D, bias=False) for i in range(P)])
        self.head = nn.ModuleList([nn.Linear(D, V, bias=False) for _ in range(P)])
        self.ln = nn.ModuleList([MLPSpeculatorLayerNorm(D) for _ in range(P)])
        self.ln0 = MLPSpeculatorLayerNorm(H, affine=False) if config.scale_input else None
        self.reset_parameters()
        if config.tie_weights:
            for i in range(1, P):
                self.emb[i].weight = self.emb[0].weight
                self.head[i].weight = self.head[0].weight
                self.ln[i].weight, self.ln[i].bias = self.ln[0].weight, self.ln[0].bias
            for i in range(2, P):
                self.proj[i].weight = self.proj[1].weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """fms-extras' initialisation: N(0, 1/sqrt(D)) for embeddings and linears, norms 1 / 0."""
        std = 1 / math.sqrt(self.config.inner_dim)
        for m in self.modules():
            if isinstance(m, (nn.Embedding, nn.Linear)):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, MLPSpeculatorLayerNorm) and m.weight is not None:
                m.weight.fill_(1.0)
                m.bias.zero_()

    def stage(self, i: int, state: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run stage ``i``.

        Args:
            i: stage index, ``0 <= i < P``.
            state: ``(B, T, H)`` target final normed hidden state at position t for ``i == 0``,
                else ``(B, T, D)`` the state stage i-1 returned.
            token_ids: ``(B, T)`` x_{t+1+i}, the token before the one this stage predicts.

        Returns:
            ``(new_state (B, T, D), logits (B, T, V))``; the logits give x_{t+2+i}.

        Raises:
            IndexError: ``i`` out of range.
        """
        state = self.stage_state(i, state, token_ids)
        return state, self.head[i](state)

    def stage_state(self, i: int, state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Stage ``i``'s new state ``(B, T, D)`` (the input of ``head[i]``); :meth:`stage` without
        the logits.

        Raises:
            IndexError: ``i`` out of range.
        """
        if not 0 <= i < self.config.n_predict:
            raise IndexError(f"stage {i} out of range for n_predict={self.config.n_predict}")
        if i == 0 and self.ln0 is not None:
            state = self.ln0(state) / math.sqrt(2.0)  # (B, T, H)
        z = self.emb[i](token_ids)  # (B, T, D)
        state = self.proj[i](state)  # (B, T, D)
        # state_w * s + emb_w * z up to the scale the following norm removes
        state = state + (self.config.emb_weight / self.config.state_weight) * z
        return F.gelu(self.ln[i](state))  # (B, T, D)

    def forward(self, state: torch.Tensor, input_ids: torch.Tensor,
                head_fn: HeadFn | None = None) -> torch.Tensor | list[Any]:
        """Teacher-forced logits of every stage.

        Args:
            state: ``(B, T, H)`` target final normed hidden states.
            input_ids: ``(B, T + P)`` the sequence from x_t on; stage i at position t reads
                ``input_ids[:, 1 + i : 1 + i + T]`` = x_{t+1+i}.
            head_fn: training: called as ``head_fn(i, state rows (B*T, D), head[i])`` with each
                stage's state instead of projecting it (:data:`HeadFn`); forward then returns
                the P results as a list and builds no logits.

        Returns:
            ``(P, B, T, V)``; ``[i, :, t]`` is the distribution of x_{t+2+i}. With ``head_fn``:
            the list of its P results.

        Raises:
            ValueError: ``input_ids`` is not ``T + P`` long.
        """
        T, P = state.shape[1], self.config.n_predict
        if input_ids.shape[1] != T + P:
            raise ValueError(f"input_ids has {input_ids.shape[1]} positions, expected T + n_predict = {T + P}")
        out = []
        for i in range(P):
            state = self.stage_state(i, state, input_ids[:, 1 + i : 1 + i + T])  # (B, T, D)
            out.append(self.head[i](state) if head_fn is None else head_fn(i, state.flatten(0, -2), self.head[i]))
        return out if head_fn is not None else torch.stack(out)  # (P, B, T, V)
