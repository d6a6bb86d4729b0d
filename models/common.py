"""What the draft models share: the target's text config, RoPE in both spellings, the
Llama-style layer geometry of the EAGLE-3 / P-EAGLE / DFlash configs, the base of the drafts that
embed with the target's embedding, the training step's distillation targets and ``shift_left``.

Imports nothing from the rest of draftsmith (``models`` is the bottom room).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


def text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal) transformers config: its
    ``text_config`` when it has one, else the config itself."""
    return getattr(config, "text_config", None) or config


def rope_theta_and_scaling(rope_parameters: dict[str, Any] | None, rope_theta: float | None = None,
                           rope_scaling: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either spelling of a Llama-style RoPE config.

    transformers >= 5 keeps theta and scaling together in ``rope_parameters``; older configs
    (and older exports) have ``rope_theta`` + ``rope_scaling``. When ``rope_parameters`` is
    given it wins; ``rope_scaling`` is None for the ``default`` rope type. Theta defaults to
    10000 (Llama's).
    """
    if rope_parameters:
        theta = rope_parameters.get("rope_theta") or rope_theta
        scaling = None
        if rope_parameters.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    else:
        theta, scaling = rope_theta, rope_scaling
    return float(theta or 10000.0), (dict(scaling) if scaling else None)



class LayerGeometry:
    """Base of the draft configs built from Llama-style decoder layers (EAGLE-3, P-EAGLE,
    DFlash): the geometry they copy from the target and RoPE in transformers >= 5's spelling.
    Subclasses are dataclasses with ``rope_theta`` and ``rope_scaling`` fields."""

    rope_theta: float
    rope_scaling: dict[str, Any] | None

    @staticmethod
    def target_geometry(target_config: Any) -> dict[str, Any]:
        """The fields a draft copies from a transformers target config (Llama-like, Qwen3 or
        gpt-oss): hidden / MLP / attention sizes, vocab, norm eps, activation and RoPE (YaRN
        included, so draft positions rotate exactly as vLLM rotates them at serving time)."""
        text = text_config(target_config)
        heads = text.num_attention_heads
        rope_theta, rope_scaling = rope_theta_and_scaling(getattr(text, "rope_parameters", None),
                                                          getattr(text, "rope_theta", None),
                                                          getattr(text, "rope_scaling", None))
        return dict(
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", heads) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
            hidden_act=getattr(text, "hidden_act", "silu"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
        )

    def rope_parameters(self) -> dict[str, Any]:
        """RoPE in transformers >= 5's ``rope_parameters`` spelling (inverse of
        :func:`rope_theta_and_scaling`)."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters.update(self.rope_scaling)
            rope_parameters["rope_type"] = self.rope_scaling.get(
                "rope_type", self.rope_scaling.get("type", "default")
            )
        return rope_parameters


@dataclass
class DistillTargets:
    """What a draft's ``forward`` distils its rows towards when the training loss is computed inside
    the forward (DFlash block slots, P-EAGLE COD elements): calling it on the forward's pre-norm
    hidden rows runs ``distill`` (``draftsmith.train.losses.chunked_distill``: chunks of rows, each
    recomputed in backward, so no ``(M, Vd)`` float32 tensor lives until backward). Reads nothing on
    the host.

    Attributes:
        teacher: ``(N, Vd)`` target logits over the draft vocab (no grad), computed once per batch.
        teacher_index: int64, the ``teacher`` row of each hidden row, shaped like the rows without H.
        weight: float, the loss weight of each hidden row (0: not trained), same shape.
        distill: ``chunked_distill`` itself (models import nothing from ``train/``):
            ``distill(rows (M, H), logits_fn, teacher, teacher_index (M,), weight (M,), loss, chunk_size)``.
        loss: the divergence (``train.loss``, a ``LossSpec``); None: forward KL.
        chunk_size: rows per loss chunk (None: ``chunk_rows`` of Vd, ``train.loss_chunk_rows``).
        rows: optional ``(M,)`` int64 indices of the flattened hidden rows to train: then
            ``teacher_index`` and ``weight`` are ``(M,)``, aligned with ``rows`` (the other rows are
            never projected by the ``lm_head``).
    """

    teacher: torch.Tensor
    teacher_index: torch.Tensor
    weight: torch.Tensor
    distill: Callable[..., Any]
    loss: Any = None
    chunk_size: int | None = None
    rows: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``hidden (..., H)`` rows (aligned with ``teacher_index`` / ``weight``, or indexed by
        ``rows``) -> what ``distill`` returns (``DistillOut``)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.rows is not None:
            flat = flat.index_select(0, self.rows)
        return self.distill(flat, logits_fn, self.teacher, self.teacher_index.reshape(-1), self.weight.reshape(-1),
                            self.loss, self.chunk_size)


class TargetSharedDraft(nn.Module):
    """Base of the drafts that embed with the target's (frozen) embedding and predict over a
    draft vocab (EAGLE-3, DFlash, P-EAGLE). Subclasses define ``config`` (``vocab_size``,
    ``draft_vocab_size``), ``embed_tokens [V, H]``, ``lm_head``, ``norm`` and the ``d2t`` /
    ``t2d`` buffers."""

    @torch.no_grad()
    def init_from_target(
        self,
        embed_tokens: torch.Tensor,
        lm_head_draft_rows: torch.Tensor | None = None,
        final_norm: torch.Tensor | None = None,
    ) -> None:
        """Load the target embedding ``[V, H]`` (a frozen buffer kept in the target's dtype; the
        looked-up rows are cast to the hidden states' dtype) and, optionally, start ``lm_head``
        from the target's ``lm_head`` rows of the draft vocab ``[Vd, H]`` and ``norm`` from the
        target's final norm ``[H]``.

        Raises:
            ValueError: the embedding is not ``(vocab_size, hidden_size)``.
        """
        if tuple(embed_tokens.shape) != tuple(self.embed_tokens.shape):
            raise ValueError(
                f"target embedding has shape {tuple(embed_tokens.shape)}, draft expects "
                f"{tuple(self.embed_tokens.shape)} (vocab_size x hidden_size)"
            )
        if isinstance(self.embed_tokens, nn.Parameter):  # trained embedding (P-EAGLE train_embeddings)
            self.embed_tokens.copy_(embed_tokens)
        else:  # the frozen buffer keeps the target's dtype (bf16 for a bf16 target: half the memory)
            self.embed_tokens = embed_tokens.detach().to(self.embed_tokens.device).clone()
        if lm_head_draft_rows is not None:
            self.lm_head.weight.copy_(lm_head_draft_rows)
        if final_norm is not None:
            self.norm.weight.copy_(final_norm)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocab: ``d2t`` int64 ``[Vd]`` offsets, ``t2d`` bool ``[V]``.

        Raises:
            ValueError: shapes that do not match the config.
        """
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                f"draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)



def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]``, padded with ``fill`` past the end. x: ``(B, T, ...)``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)[:, : x.shape[1]]
