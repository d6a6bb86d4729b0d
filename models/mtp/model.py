"""The target's own multi-token-prediction (MTP) layer as a trainable draft, computed as vLLM
(0.32) serves it with ``speculative_config={"method": "mtp"}``.

One MTP step at position t reads the embedding of the next token ``x_{t+1}`` and a hidden
state ``h_t`` and predicts ``x_{t+2}``:

    DeepSeek-V3 (deepseek_mtp.py):  e = embed(x_{t+1}), zeroed at position 0
                                    u = eh_proj([enorm(e) | hnorm(h_t)])
                                    o = shared_head.norm(DecoderLayer(u))
    Qwen3-Next (qwen3_next_mtp.py): u = fc([pre_fc_norm_embedding(e) | pre_fc_norm_hidden(h_t)])
                                    o = norm(DecoderLayer(u))
    logits = lm_head(o)             (vLLM gives the MTP layer the target's lm_head and embedding)

``DecoderLayer`` is the family's transformers decoder layer (DeepSeek-V3: MLA attention and
the routed + shared experts; Qwen3-Next: gated full attention and the sparse MoE). Step 0's
``h_t`` is the target's final normed hidden state (what vLLM's target model returns and the
prepared shards hold as ``final_hidden_states``); vLLM runs step k > 0 on the MTP layer again
at position ``t + k`` with the previous step's ``o`` as ``h`` (DeepSeek's ``model_returns_tuple``:
the post-norm hidden is recycled) and the drafted token's embedding.

Training unrolls K steps the way EAGLE-3 trains (training-time test): step k's query at row t
(position t + k, token ``x_{t+k+1}`` teacher-forced, ``h`` = step k-1's ``o`` at row t) attends to
step 0's keys at rows <= t and to its own chain's keys of steps 1..k at row t
(:func:`~draftsmith.models.eagle3.masks.ttt_attention_mask`): the KV cache vLLM's MTP layer holds
when it drafts token k + 1 after position t.

Shapes: B batch, T sequence length, H target hidden size, V target vocab size.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..common import shift_left
from ..eagle3.masks import ttt_attention_mask
from .config import MTPConfig

StepHead = Callable[[int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], Any]
"""``step_head(k, o (B, T, H), logits_fn)``: what training does with step k's output."""


def layer_config(cfg: MTPConfig) -> Any:
    """The transformers config the MTP decoder layer is built from: the target's, with SDPA
    attention (Qwen3-Next: one full-attention MoE layer)."""
    tc = dict(cfg.target_config)
    for key in ("architectures", "auto_map", "quantization_config", "transformers_version", "torch_dtype", "dtype"):
        tc.pop(key, None)
    if cfg.family == "deepseek_v3":
        from transformers import DeepseekV3Config

        config = DeepseekV3Config(**tc)
    else:
        from transformers import Qwen3NextConfig

        tc.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[], decoder_sparse_step=1)
        config = Qwen3NextConfig(**tc)
    config._attn_implementation = "sdpa"
    return config


class FrozenLMHead(nn.Module):
    """The target's ``lm_head`` ``weight [V, H]``: a non-persistent buffer (vLLM replaces the MTP
    layer's head with the target's at load time, so it is never trained nor saved)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(vocab_size, hidden_size), persistent=False)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        return F.linear(o, self.weight.to(o.dtype))


class _Module(nn.Module):
    """A named container (``shared_head``)."""


class MTPLayer(nn.Module):
    """One MTP layer of the target's family; parameter names are the checkpoint's under the
    family's prefix (:mod:`.weights`).

    DeepSeek-V3 (under ``model.layers.{num_hidden_layers + i}.``): ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and the decoder layer as ``mtp_block`` (vLLM's naming; the
    checkpoint stores its tensors without that infix). Qwen3-Next (under ``mtp.``):
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, ``norm`` (zero-centred RMSNorms,
    ``1 + weight``) and the decoder layer as ``layers.0``. The MoE experts are transformers'
    fused ``gate_up_proj`` / ``down_proj``, split per expert on export.
    """

    def __init__(self, cfg: MTPConfig, config: Any):
        super().__init__()
        self.family = cfg.family
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.family == "deepseek_v3":
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

            self.enorm = DeepseekV3RMSNorm(H, eps=eps)
            self.hnorm = DeepseekV3RMSNorm(H, eps=eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
            # built at its own index: MoE past first_k_dense_replace, as the target's MTP layer is
            self.mtp_block = DeepseekV3DecoderLayer(config, layer_idx=cfg.num_hidden_layers)
            self.mtp_block.self_attn.layer_idx = 0  # its own cache (MTPDraftModel.forward)
            self.shared_head = _Module()
            self.shared_head.norm = DeepseekV3RMSNorm(H, eps=eps)
        else:
            from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

            self.pre_fc_norm_embedding = Qwen3NextRMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = Qwen3NextRMSNorm(H, eps=eps)
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, layer_idx=0)])
            self.norm = Qwen3NextRMSNorm(H, eps=eps)

    @property
    def block(self) -> nn.Module:
        """The decoder layer."""
        return self.mtp_block if self.family == "deepseek_v3" else self.layers[0]

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T, H)`` embedding of the next token and hidden state -> the decoder layer's input."""
        if self.family == "deepseek_v3":
            embeds = torch.where(position_ids.unsqueeze(-1) == 0, 0, embeds)  # vLLM: no embedding at position 0
            return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def output_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output -> ``o``, the logits' input and the next step's hidden state."""
        return self.shared_head.norm(h) if self.family == "deepseek_v3" else self.norm(h)


class MTPDraftModel(nn.Module):
    """The target's MTP layer with the target's embedding and ``lm_head`` (frozen buffers).

    ``forward(input_ids (B, T), hidden (B, T, H), steps) -> [logits (B, T, V)] * steps``: step k's
    row t predicts ``x_{t+k+2}`` (rows past ``T - k - 2`` read padding and are not trained).
    """

    _no_split_modules = ["MTPLayer"]  # the FSDP unit

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        self.layer_config = layer_config(config)
        self.mtp = MTPLayer(config, self.layer_config)
        H, V = config.hidden_size, config.vocab_size
        self.register_buffer("embed_tokens", torch.zeros(V, H), persistent=False)
        self.lm_head = FrozenLMHead(V, H)
        self.logits_norm = None  # the fused loss's (norm, lm_head) pair: o is already normed
        if config.family == "deepseek_v3":
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding as Rotary
        else:
            from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding as Rotary
        self.rotary_emb = Rotary(self.layer_config)

    @torch.no_grad()
    def init_from_target(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """The target's embedding and ``lm_head`` ``[V, H]`` (kept in the target's dtype).

        Raises:
            ValueError: either is not ``(vocab_size, hidden_size)``.
        """
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, t in (("embedding", embed_tokens), ("lm_head", lm_head)):
            if tuple(t.shape) != want:
                raise ValueError(f"target {name} has shape {tuple(t.shape)}, the MTP layer needs {want}")
        self.embed_tokens = embed_tokens.detach().clone()
        self.lm_head.weight = lm_head.detach().clone()

    def compute_logits(self, o: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` MTP output -> ``(..., V)`` logits with the target's ``lm_head``."""
        return self.lm_head(o)

    compute_logits.fused_as = ("logits_norm", "lm_head")  # lm_head(o): the fused loss may run it (train/losses.py)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
             cache: Any) -> torch.Tensor:
        """One MTP step: ``tokens (B, T)`` (each row's next token), ``hidden (B, T, H)``,
        ``position_ids (B, T)``, ``mask`` bool ``(B, 1, T, S)`` over the ``S`` keys in ``cache``
        after this step's are appended; returns ``o (B, T, H)`` (post-norm)."""
        dtype = self.mtp.block.input_layernorm.weight.dtype
        embeds = F.embedding(tokens, self.embed_tokens).to(dtype)
        u = self.mtp.fuse(embeds, hidden.to(dtype), position_ids)
        cos_sin = self.rotary_emb(u, position_ids)
        h = self.mtp.block(u, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                               position_embeddings=cos_sin, use_cache=True)
        return self.mtp.output_norm(h)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, steps: int = 1, _unused: Any = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                step_head: StepHead | None = None) -> list[Any]:
        """Unroll ``steps`` MTP steps (training-time test, module docstring).

        Args:
            input_ids: ``(B, T)`` x_0 .. x_{T-1}.
            hidden: ``(B, T, H)`` the target's final normed hidden states h_0 .. h_{T-1}.
            steps: K >= 1.
            position_ids: ``(B, T)`` per-document positions of packed rows; default ``0 .. T-1``.
            document_ids: ``(B, T)`` packed rows' document ids (attention stays in a document).
            step_head: training: called as ``step_head(k, o_k, compute_logits)`` instead of
                building logits; forward then returns its K results.

        Returns:
            K ``(B, T, V)`` logits (or the K ``step_head`` results).
        """
        from transformers import DynamicCache

        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        cache = DynamicCache()
        outs, h = [], hidden
        for k in range(steps):
            mask = ttt_attention_mask(T, k, input_ids.device, document_ids)
            mask = (mask.unsqueeze(1) if mask.dim() == 3 else mask.expand(B, 1, T, (k + 1) * T))
            o = self.step(shift_left(input_ids, k + 1), h, position_ids + k, mask, cache)
            outs.append(self.compute_logits(o) if step_head is None else step_head(k, o, self.compute_logits))
            h = o
        return outs
